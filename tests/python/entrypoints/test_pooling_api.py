"""The pooling routes of `vpage serve` on tiny random encoders saved locally: `/v1/embeddings`
through the official `openai` client (float and base64) equal to sentence-transformers'
`encode`, Matryoshka dimensions, token-id inputs; `/score` and `/rerank` by embeddings (cosine)
and by a cross-encoder (equal to `CrossEncoder.predict`); `/pooling`; bad requests answered
with a 400 and the server serving on; the other runner's routes refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from live_server import LiveServer

openai = pytest.importorskip("openai")
st = pytest.importorskip("sentence_transformers")
st_models = pytest.importorskip("sentence_transformers.models")
transformers = pytest.importorskip("transformers")

WORDS = ("the quick brown fox jumps over lazy dog paris is capital of france berlin germany rome italy city "
         "river big small old new a an and in on at").split()
TEXTS = ["the quick brown fox", "paris is the capital of france", "a",
         " ".join(WORDS * 3)]  # 1 to 100+ tokens in one request


def _tiny_bert(folder, cls, **config):
    (folder).mkdir(parents=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS))
    tokenizer = transformers.BertTokenizerFast(str(folder / "vocab.txt"))
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(WORDS) + 5, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=128, **config)
    cls(cfg).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A sentence-transformers folder: BERT, mean pooling, normalised."""
    root = tmp_path_factory.mktemp("embedder")
    bert = _tiny_bert(root / "bert", transformers.BertModel)
    model = st.SentenceTransformer(modules=[st_models.Transformer(str(bert)), st_models.Pooling(64, "mean"),
                                            st_models.Normalize()], device="cpu")
    model.save(str(root / "st"))
    return root / "st", model


@pytest.fixture(scope="module")
def embed_server(embedder):
    srv = LiveServer("--model", str(embedder[0]), "--served-model-name", "emb", "--max-num-batched-tokens", "64")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(embed_server):
    return openai.OpenAI(base_url=embed_server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_embeddings_equal_sentence_transformers(client, embedder):
    reference = embedder[1].encode(TEXTS, convert_to_numpy=True)
    for encoding in ("float", "base64"):  # the openai client asks for base64 and decodes it itself by default
        kwargs = {"encoding_format": encoding} if encoding == "float" else {}
        response = client.embeddings.create(model="emb", input=TEXTS, **kwargs)
        assert [d.index for d in response.data] == list(range(len(TEXTS)))
        np.testing.assert_allclose(np.array([d.embedding for d in response.data]), reference, atol=1e-5)
    tokens = [embedder[1].tokenizer(t)["input_ids"] for t in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(t) for t in tokens)
    by_ids = client.embeddings.create(model="emb", input=tokens[1], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, reference[1], atol=1e-5)
    short = client.embeddings.create(model="emb", input=TEXTS[:2], dimensions=16, encoding_format="float")
    cut = reference[:2, :16] / np.linalg.norm(reference[:2, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(np.array([d.embedding for d in short.data]), cut, atol=1e-5)


def test_score_and_rerank_by_embeddings(embed_server, embedder):
    reference = embedder[1].encode(TEXTS, convert_to_numpy=True)
    status, body = embed_server.request("POST", "/score", {"model": "emb", "text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in body["data"]], reference[1:] @ reference[0], atol=1e-5)
    status, body = embed_server.request("POST", "/v1/rerank", {"query": TEXTS[0], "documents": TEXTS[1:],
                                                               "top_n": 2, "return_documents": False})
    order = np.argsort(-(reference[1:] @ reference[0]))[:2]
    assert status == 200 and [r["index"] for r in body["results"]] == list(order)
    assert all("document" not in r for r in body["results"]) and body["usage"]["total_tokens"] > 0
    status, body = embed_server.request("POST", "/pooling", {"input": TEXTS[0]})
    np.testing.assert_allclose(body["data"][0]["data"], reference[0], atol=1e-5)


def test_bad_requests_are_400_and_the_server_serves(embed_server, client, embedder):
    long_ids = [7] * 200  # over the 128 positions
    bad = [("/v1/embeddings", {"input": []}), ("/v1/embeddings", {"input": ""}),
           ("/v1/embeddings", {"input": [[5, 6, 10_000]]}), ("/v1/embeddings", {"input": [long_ids]}),
           ("/v1/embeddings", {"input": "a", "dimensions": 65}),
           ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}),
           ("/rerank", {"query": "a", "documents": []}), ("/classify", {"input": "a"}),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]
    for path, body in bad:
        status, answer = embed_server.request("POST", path, body)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", (path, body, answer)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="another-model", input="a")
    cut = client.embeddings.create(model="emb", input=[long_ids], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 50})
    assert cut.usage.prompt_tokens == 50
    embed_server.wait_idle()
    assert embed_server.request("GET", "/health")[0] == 200
    again = client.embeddings.create(model="emb", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(again.data[0].embedding, embedder[1].encode(TEXTS[:1])[0], atol=1e-5)
    assert embed_server.metric("request_success_total") > 0 and embed_server.metric("prompt_tokens_total") > 0


def test_a_client_that_leaves_aborts_its_prompts(embed_server):
    import json
    import socket
    import time

    before = embed_server.metric("request_success_total")
    body = json.dumps({"input": [[7] * 120] * 2000}).encode()  # ~2000 steps at a 64-token budget
    sock = socket.create_connection(("127.0.0.1", embed_server.port))
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    time.sleep(0.5)
    sock.close()
    embed_server.wait_idle()
    assert embed_server.metric("request_success_total") - before < 2000  # the rest were aborted
    assert embed_server.request("POST", "/v1/embeddings", {"input": "a"})[0] == 200


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    folder = _tiny_bert(tmp_path_factory.mktemp("cross") / "bert", transformers.BertForSequenceClassification,
                        num_labels=1)
    return folder, st.CrossEncoder(str(folder), device="cpu")


def test_cross_encoder_scores_equal_crossencoder_predict(cross_encoder):
    folder, reference = cross_encoder
    pairs = [(TEXTS[0], t) for t in TEXTS[1:]]
    expected = reference.predict(pairs)
    srv = LiveServer("--model", str(folder), "--runner", "pooling", "--served-model-name", "rerank")
    try:
        status, body = srv.request("POST", "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]})
        assert status == 200
        np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-5)
        status, body = srv.request("POST", "/rerank", {"query": TEXTS[0], "documents": TEXTS[1:]})
        assert [r["index"] for r in body["results"]] == list(np.argsort(-expected))
        assert [r["document"]["text"] for r in body["results"]] == [TEXTS[1:][i] for i in np.argsort(-expected)]
        status, body = srv.request("POST", "/v1/embeddings", {"input": "a"})
        assert status == 400 and "does not support embeddings" in body["error"]["message"]
        status, body = srv.request("POST", "/classify", {"input": [[2, 9, 10, 3], [2, 11, 3]]})
        assert status == 200 and [(d["label"], d["num_classes"]) for d in body["data"]] == [("LABEL_0", 1)] * 2
        logits = [reference.model(torch.tensor([ids])).logits[0, 0].item() for ids in ([2, 9, 10, 3], [2, 11, 3])]
        np.testing.assert_allclose([d["probs"][0] for d in body["data"]], 1 / (1 + np.exp(-np.array(logits))),
                                   atol=1e-5)
    finally:
        srv.stop()
