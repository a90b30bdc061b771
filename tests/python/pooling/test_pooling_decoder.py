"""A decoder embedding model (Qwen3-Embedding's kind): a tiny Qwen3 saved as a
sentence-transformers folder with last-token pooling, run on the paged engine (chunked prefill,
the prefix cache); against sentence-transformers' own embeddings."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from model_fixtures import save_tiny_model
from vpage import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TEXTS = ["the quick brown fox", "paged attention keeps the kv cache in fixed size blocks " * 6, "a",
         "héllo wörld, ünïcode façade", "the lazy dog " * 20]


@pytest.fixture(scope="module")
def qwen3_st(tmp_path_factory):
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import models

    folder = tmp_path_factory.mktemp("qwen3-embedding")
    save_tiny_model("qwen3", folder / "hf", seed=4)
    transformer = models.Transformer(str(folder / "hf"))
    transformer.tokenizer.pad_token = "<unk>"  # sentence-transformers pads its batches
    st = SentenceTransformer(modules=[transformer, models.Pooling(64, "lasttoken"), models.Normalize()], device="cpu")
    st.save(str(folder / "st"))
    return folder, st


def test_last_token_embeddings_match_sentence_transformers(qwen3_st):
    folder, st = qwen3_st
    llm = LLM(str(folder / "st"), max_num_batched_tokens=48, kv_cache_memory=0.05)  # long prompts in chunks
    assert llm.engine.pooler_config.pooling_type == "LAST" and llm.engine.supported_tasks == {"embed", "score"}
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    expected = np.stack([st.encode([t], convert_to_numpy=True)[0] for t in TEXTS])
    assert np.abs(got - expected).max() < 1e-5
    # Asked again, the prompts' blocks come from the prefix cache; results do not depend on the batch.
    hits = llm.engine.engine.get_stats().prefix_cache_hits
    again = np.array([o.outputs.embedding for o in llm.embed(TEXTS[::-1], use_tqdm=False)])[::-1]
    assert llm.engine.engine.get_stats().prefix_cache_hits > hits and np.abs(again - got).max() < 1e-5
    assert not llm.engine.has_unfinished_requests() and not llm.engine.engine.core.requests


def test_qwen3_embedding_layout(qwen3_st, tmp_path):
    """Qwen3-Embedding's own folder: its config names Qwen3ForCausalLM, its weights are the base
    model's (no ``model.`` prefix, no lm_head)."""
    folder, st = qwen3_st
    import shutil

    shutil.copytree(folder / "st", tmp_path / "st")
    config = json.loads((tmp_path / "st" / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (tmp_path / "st" / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path / "st"), runner="pooling", kv_cache_memory=0.05)
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    expected = np.stack([st.encode([t], convert_to_numpy=True)[0] for t in TEXTS])
    assert np.abs(got - expected).max() < 1e-5


def test_runner_choice_for_decoders(qwen3_st):
    folder, _ = qwen3_st
    assert LLM(str(folder / "st")).runner == "pooling"  # "auto": a base model (Qwen3Model) pools, as in vLLM
    assert LLM(str(folder / "hf"), kv_cache_memory=0.01).runner == "generate"  # and a Qwen3ForCausalLM generates
    with pytest.raises(ValueError, match="decoder without a sentence-transformers config"):
        LLM(str(folder / "hf"), runner="pooling")
    plain = LLM(str(folder / "hf"), runner="pooling", pooler_config={"pooling_type": "LAST"})
    pooled = LLM(str(folder / "st"), runner="pooling")
    a = plain.embed(TEXTS[:2], use_tqdm=False)
    b = pooled.embed(TEXTS[:2], use_tqdm=False)
    assert np.abs(np.array([o.outputs.embedding for o in a]) - np.array([o.outputs.embedding for o in b])).max() < 1e-5


def test_served_decoder_embeddings(qwen3_st):
    """`vpage serve` on the folder: /v1/embeddings through the paged engine, as offline."""
    from live_server import LiveServer

    folder, st = qwen3_st
    srv = LiveServer("--model", str(folder / "st"), "--kv-cache-memory", "0.05", "--served-model-name", "emb")
    try:
        status, body = srv.request("POST", "/v1/embeddings", {"input": TEXTS, "dimensions": 32})
        assert status == 200 and body["usage"]["prompt_tokens"] == sum(len(st.tokenizer(t)["input_ids"]) for t in TEXTS)
        full = np.stack([st.encode([t], convert_to_numpy=True)[0] for t in TEXTS])
        cut = full[:, :32] / np.linalg.norm(full[:, :32], axis=1, keepdims=True)
        assert np.abs(np.array([d["embedding"] for d in body["data"]]) - cut).max() < 1e-5
        status, body = srv.request("POST", "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:3]})
        assert status == 200 and np.allclose([d["score"] for d in body["data"]], full[1:3] @ full[0], atol=1e-5)
        status, body = srv.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "pooling runner" in body["error"]["message"]
    finally:
        srv.stop()


def test_tensor_parallel_embeddings_equal_one_rank(qwen3_st):
    folder, _ = qwen3_st
    one = LLM(str(folder / "st"), kv_cache_memory=0.05)
    two = LLM(str(folder / "st"), kv_cache_memory=0.05, tensor_parallel_size=2)
    try:
        a = np.array([o.outputs.embedding for o in one.embed(TEXTS, use_tqdm=False)])
        b = np.array([o.outputs.embedding for o in two.embed(TEXTS, use_tqdm=False)])
        assert np.abs(a - b).max() < 1e-5
    finally:
        two.shutdown()
