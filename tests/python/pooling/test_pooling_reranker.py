"""A causal LM as a classifier of its next-token logits, with vLLM's ``hf_overrides``
(Qwen3-Reranker: ``classifier_from_token: [no, yes]``, ``is_original_qwen3_reranker``): a tiny
Qwen3 on the paged engine scores pairs as sigmoid(logit of yes - logit of no) at the last token,
and classifies by the softmax of the class tokens' logits, against transformers' own logits;
offline and through `vpage serve`'s /score and /rerank."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from live_server import LiveServer
from model_fixtures import save_tiny_model
from vpage import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")
QUERY = "the quick brown fox"
DOCS = ["jumps over the lazy dog", "a", "the quick brown fox " * 5, "paged attention keeps blocks"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The folder, its tokenizer, transformers' model of it, and the class tokens (no, yes, maybe)."""
    import transformers

    folder = tmp_path_factory.mktemp("qwen3-reranker")
    save_tiny_model("qwen3", folder, seed=7)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    return folder, tokenizer, model, tokenizer.convert_ids_to_tokens([100, 101, 102])


def _last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].double()


def _overrides(tokens: list[str], binary: bool) -> dict:
    return {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens,
            "is_original_qwen3_reranker": binary}


def test_scores_and_classes_equal_the_logits(qwen3):
    folder, tokenizer, model, tokens = qwen3
    no, yes = tokenizer.convert_tokens_to_ids(tokens[:2])
    llm = LLM(str(folder), runner="pooling", hf_overrides=_overrides(tokens[:2], True), kv_cache_memory=0.05)
    assert llm.engine.supported_tasks == {"classify", "score"} and llm.engine.is_cross_encoder
    scores = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    expected = []
    for doc in DOCS:
        logits = _last_logits(model, tokenizer(QUERY, doc)["input_ids"])
        expected.append(float(torch.sigmoid(logits[yes] - logits[no])))
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    with pytest.raises(ValueError, match="pooling tasks"):
        llm.embed(["a"], use_tqdm=False)
    three = LLM(str(folder), runner="pooling", hf_overrides=_overrides(tokens, False), kv_cache_memory=0.05)
    probs = np.array([o.outputs.probs for o in three.classify(DOCS, use_tqdm=False)])
    ids = tokenizer.convert_tokens_to_ids(tokens)
    expected = np.stack([torch.softmax(_last_logits(model, tokenizer(d)["input_ids"])[ids], 0).numpy() for d in DOCS])
    np.testing.assert_allclose(probs, expected, atol=1e-5)


def test_bad_overrides(qwen3):
    folder, _, _, tokens = qwen3
    for overrides, needle in ((dict(_overrides(tokens[:2], True), rope_theta=1.0), "hf_overrides"),
                              (_overrides(["no-such-token-here"], False), "not tokens"),
                              (_overrides(tokens, True), "two tokens")):
        with pytest.raises(ValueError, match=needle):
            LLM(str(folder), runner="pooling", hf_overrides=overrides, kv_cache_memory=0.05)
    with pytest.raises(ValueError, match="runner 'pooling'"):
        LLM(str(folder), hf_overrides=_overrides(tokens[:2], True), kv_cache_memory=0.05)


def test_served_reranker(qwen3):
    folder, tokenizer, model, tokens = qwen3
    no, yes = tokenizer.convert_tokens_to_ids(tokens[:2])
    srv = LiveServer("--model", str(folder), "--runner", "pooling", "--kv-cache-memory", "0.05",
                     "--hf-overrides", json.dumps(_overrides(tokens[:2], True)))
    try:
        status, body = srv.request("POST", "/rerank", {"query": QUERY, "documents": DOCS})
        assert status == 200
        expected = {}
        for i, doc in enumerate(DOCS):
            logits = _last_logits(model, tokenizer(QUERY, doc)["input_ids"])
            expected[i] = float(torch.sigmoid(logits[yes] - logits[no]))
        assert [r["index"] for r in body["results"]] == sorted(expected, key=lambda i: -expected[i])
        np.testing.assert_allclose([r["relevance_score"] for r in body["results"]],
                                   [expected[r["index"]] for r in body["results"]], atol=1e-5)
        status, body = srv.request("POST", "/v1/embeddings", {"input": "a"})
        assert status == 400 and "does not support embeddings" in body["error"]["message"]
    finally:
        srv.stop()
