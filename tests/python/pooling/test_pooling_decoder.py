"""A decoder embedding model (Qwen3-Embedding's kind): a tiny Qwen3 saved as a
sentence-transformers folder with last-token pooling, run on vpage's Qwen3 class by a causal
prefill into a scratch KV cache; against sentence-transformers' own embeddings."""

from __future__ import annotations

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
    llm = LLM(str(folder / "st"), max_num_batched_tokens=48)
    assert llm.engine.pooler_config.pooling_type == "LAST" and llm.engine.supported_tasks == {"embed", "score"}
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    expected = np.stack([st.encode([t], convert_to_numpy=True)[0] for t in TEXTS])
    assert np.abs(got - expected).max() < 1e-5
    # a second, larger step reuses (grows) the scratch cache; results do not depend on the batch
    again = np.array([o.outputs.embedding for o in LLM(str(folder / "st"), runner="pooling").embed(
        TEXTS[::-1], use_tqdm=False)])[::-1]
    assert np.abs(again - got).max() < 1e-5


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
