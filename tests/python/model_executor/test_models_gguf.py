"""Tiny Llama (Q/K rows permuted by llama.cpp's converter) and Qwen2 models written as
GGUF files: vpage's GGUF path gives the same logits as transformers on the originals."""

from __future__ import annotations

import pytest
import torch

from model_fixtures import PagedKVCache, save_tiny_gguf, save_tiny_model
from vpage.model_executor import load_model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_gguf_matches_transformers(kind, tmp_path):
    folder = tmp_path / kind
    hf = save_tiny_model(kind, folder)
    gguf_path = tmp_path / f"{kind}.gguf"
    save_tiny_gguf(hf, folder, gguf_path)
    loaded = load_model(str(gguf_path), device="cpu")
    assert loaded.config.dtype == torch.float32 and loaded.config.num_kv_heads == 2
    assert loaded.config.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[kind]
    assert not loaded.model.tie_word_embeddings
    text = "the quick brown fox"
    assert loaded.tokenizer.encode(text, add_special_tokens=False) == hf_tokens(folder, text)
    tokens = list(range(3, 30))
    cache = PagedKVCache(loaded.config)
    logits = loaded.model.compute_logits(loaded.model(cache.step({0: tokens}), cache.caches))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def hf_tokens(folder, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).encode(text, add_special_tokens=False)
