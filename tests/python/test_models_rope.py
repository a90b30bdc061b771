"""Rope scaling variants (linear, Llama-3) match transformers; unsupported ones are refused."""

from __future__ import annotations

import pytest
import torch

from model_fixtures import PagedKVCache, save_tiny_model
from vpage.model_executor import load_model

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0}, LLAMA3], ids=["linear", "llama3"])
def test_scaled_rope_matches_transformers(scaling, tmp_path):
    hf = save_tiny_model("llama", tmp_path, rope_theta=10000.0, rope_scaling=scaling)
    loaded = load_model(str(tmp_path), device="cpu")
    tokens = torch.randint(3, 320, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = PagedKVCache(loaded.config, block_size=16)
    logits = loaded.model.compute_logits(loaded.model(cache.step({0: tokens}), cache.caches))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_unsupported_rope_type_is_refused(tmp_path):
    save_tiny_model("llama", tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=f"{tmp_path}: unsupported rope scaling type .dynamic."):
        load_model(str(tmp_path), device="cpu")
