"""Mixtures of experts: tiny random Mixtral (top 2 of 4, renormalised), Qwen2-MoE (top 2 of 4,
not renormalised, a gated shared expert, a dense first layer) and Qwen3-MoE (top 3 of 8,
renormalised, per-head q/k norms) give transformers' logits from a Hugging Face folder, through
the one fused expert kernel, and transformers' greedy tokens through the engine: whole prompts,
chunked prefill, and tensor parallelism over two ranks (the experts' intermediate dimension
split, one all-reduce per block)."""

from __future__ import annotations

import pytest
import torch

from family_parity import assert_family_parity
from model_fixtures import PagedKVCache, save_tiny_model
from vpage import ops
from vpage.model_executor import load_model
from vpage.model_executor.layers.fused_moe import FusedMoE
from vpage.model_executor.layers.linear import pack_dense_weights
from vpage.model_executor.models.moe import SparseMoeBlock

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(request.param, folder, seed=5)
    for name, param in hf.named_parameters():  # routers with real spread, so no near ties
        if name.endswith("mlp.gate.weight"):
            param.data.normal_(0.0, 0.5)
    hf.save_pretrained(str(folder))
    return request.param, folder, hf


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def run_step(loaded, cache: PagedKVCache, chunks: dict[int, list[int]]) -> torch.Tensor:
    return loaded.model.compute_logits(loaded.model(cache.step(chunks), cache.caches))


def test_hf_folder_matches_transformers(tiny):
    """A prompt in two chunks beside a second sequence, then decode steps: every row's logits
    are transformers'; the experts run in the fused kernel, packed like the dense weights."""
    kind, folder, hf = tiny
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    assert loaded.config.architecture == FAMILIES[kind]
    pack_dense_weights(loaded.model)
    blocks = [m for m in loaded.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == (1 if kind == "qwen2_moe" else 2)  # Qwen2-MoE's layer 0 is dense
    assert all(isinstance(b.experts, FusedMoE) and b.experts.w1.packed is not None for b in blocks)
    assert (blocks[0].shared_expert is not None) == (kind == "qwen2_moe")
    gen = torch.Generator().manual_seed(1)
    seqs = {0: torch.randint(3, 320, (29,), generator=gen).tolist(), 1: torch.randint(3, 320, (11,), generator=gen).tolist()}
    cache = PagedKVCache(loaded.config, block_size=8)
    first = run_step(loaded, cache, {0: seqs[0][:13], 1: seqs[1]})
    ref = torch.cat([hf_logits(hf, seqs[0][:13]), hf_logits(hf, seqs[1])])
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(first, ref, atol=1e-4, rtol=0)
    rest = run_step(loaded, cache, {0: seqs[0][13:]})
    torch.testing.assert_close(rest, hf_logits(hf, seqs[0])[13:], atol=1e-4, rtol=0)
    for _ in range(2):
        step = {s: [int(torch.randint(3, 320, (1,), generator=gen))] for s in seqs}
        for s, t in step.items():
            seqs[s] += t
        logits = run_step(loaded, cache, step)
        ref = torch.stack([hf_logits(hf, t)[-1] for t in seqs.values()])
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_the_experts_run_in_the_fused_kernel(tiny, monkeypatch):
    """Every MoE block's experts go through ops.fused_moe, once per block and step."""
    kind, folder, _ = tiny
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    calls = []
    fused = ops.fused_moe
    monkeypatch.setattr(ops, "fused_moe", lambda *a, **k: calls.append(a[0].shape[0]) or fused(*a, **k))
    run_step(loaded, PagedKVCache(loaded.config, block_size=8), {0: list(range(3, 20))})
    assert calls == [17] * (1 if kind == "qwen2_moe" else 2)


@pytest.mark.parametrize("setting", ["plain", "chunked", "prefix", "preempt", pytest.param("tp2", marks=pytest.mark.slow)])
def test_engine_matches_transformers(tiny, setting):
    _, folder, hf = tiny
    assert_family_parity(folder, hf, [setting], prompt_len=37)
