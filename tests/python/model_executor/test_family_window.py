"""Sliding windows in the model: tiny Mistral (a 16-token window on every layer) and Qwen2
(use_sliding_window, max_window_layers=1: layer 0 global, the others windowed) pass each
layer's window to its PagedAttention (and the C++ layer loop: test_cpu_decoder_families.py),
and give transformers' logits and greedy tokens on prompts and second turns longer than the
window. Models without a window (or with one no shorter than their positions) call the
kernels exactly as before.

The logits and engine tests need attention kernels with ``sliding_window`` and skip until
those land; one test runs the windowed model now over a float64 stand-in for the kernels,
which checks the model's side (which layers are windowed, transformers' mask p - W < j <= p).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from family_parity import assert_family_parity, setting_params
from kv_reference import gather_kv
from model_fixtures import PagedKVCache, save_tiny_model
from vpage import ops
from vpage.model_executor import load_model

WINDOW = 16
HAS_WINDOW_KERNELS = "sliding_window" in inspect.signature(ops.paged_attention).parameters
needs_window_kernels = pytest.mark.skipif(not HAS_WINDOW_KERNELS,
                                          reason="the attention kernels take no sliding_window yet")

# name -> (kind, tiny-config overrides, per-layer windows vpage must use)
CASES = {
    "mistral": ("mistral", dict(sliding_window=WINDOW), (WINDOW, WINDOW)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, num_hidden_layers=3),
              (None, WINDOW, WINDOW)),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=list(CASES))
def windowed(request, tmp_path_factory):
    kind, overrides, windows = CASES[request.param]
    folder = tmp_path_factory.mktemp(f"{request.param}-window")
    hf = save_tiny_model(kind, folder, seed=11, **overrides)
    return folder, hf, windows


def _windowed_reference(query, key_cache, value_cache, block_tables, context_lens, query_start_loc, scale,
                        window):
    """float64 paged attention where the query at position p sees keys p - window < j <= p."""
    out = torch.empty(query.shape, dtype=torch.float64)
    lens = context_lens.tolist()
    starts = query_start_loc.tolist() if query_start_loc is not None else list(range(len(lens) + 1))
    for s, length in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        if a == b:
            continue
        k, v = gather_kv(key_cache, value_cache, block_tables[s].cpu(), length)
        group = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", query[a:b].double().cpu(), k) * scale
        pos = torch.arange(length - (b - a), length)[:, None]
        keys = torch.arange(length)[None, :]
        hidden = (keys > pos) | ((keys <= pos - window) if window is not None else False)
        probs = torch.softmax(logits.masked_fill(hidden[None], float("-inf")), dim=-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def _reference_kernels(monkeypatch):
    """Replace ops.paged_attention / paged_prefill_attention by the windowed reference."""

    def decode(query, key_cache, value_cache, block_tables, context_lens, scale, max_context_len=None, out=None,
               sliding_window=None):
        out.copy_(_windowed_reference(query, key_cache, value_cache, block_tables, context_lens, None, scale,
                                      sliding_window))
        return out

    def prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
                max_context_len=None, out=None, sliding_window=None):
        out.copy_(_windowed_reference(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                                      scale, sliding_window))
        return out

    monkeypatch.setattr(ops, "paged_attention", decode)
    monkeypatch.setattr(ops, "paged_prefill_attention", prefill)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def assert_logits_past_the_window(hf, loaded):
    """Chunks of 13 and 16 then three decode steps (contexts up to 32 = twice the window),
    beside a short sequence: every row's logits are transformers' on the whole sequence."""
    gen = torch.Generator().manual_seed(2)
    seqs = {0: torch.randint(3, 320, (29,), generator=gen).tolist(), 1: torch.randint(3, 320, (6,), generator=gen).tolist()}
    cache = PagedKVCache(loaded.config, block_size=8)

    def step(chunks):
        return loaded.model.compute_logits(loaded.model(cache.step(chunks), cache.caches))

    ref = torch.cat([hf_logits(hf, seqs[0][:13]), hf_logits(hf, seqs[1])])
    torch.testing.assert_close(step({0: seqs[0][:13], 1: seqs[1]}), ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(step({0: seqs[0][13:]}), hf_logits(hf, seqs[0])[13:], atol=1e-4, rtol=0)
    for _ in range(3):
        new = {s: [int(torch.randint(3, 320, (1,), generator=gen))] for s in seqs}
        for s, t in new.items():
            seqs[s] += t
        ref = torch.stack([hf_logits(hf, t)[-1] for t in seqs.values()])
        torch.testing.assert_close(step(new), ref, atol=1e-4, rtol=0)


def test_layers_get_their_windows(windowed):
    folder, hf, windows = windowed
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    assert tuple(layer.self_attn.attn.sliding_window for layer in loaded.model.model.layers) == windows
    assert loaded.model.has_cpu_decoder_structure()  # the C++ loop takes each layer's window


@pytest.mark.parametrize("kind, overrides", [("llama", {}), ("mistral", {}), ("qwen2", dict(sliding_window=WINDOW))])
def test_models_without_a_window_call_the_kernels_as_before(kind, overrides, tmp_path, monkeypatch):
    """Llama; Mistral with transformers' default window (4096, past its 256 positions: masks
    nothing); Qwen2 with a window but use_sliding_window off: no layer is windowed, the
    kernels get no sliding_window, and the C++ loop still serves the model."""
    save_tiny_model(kind, tmp_path, **overrides)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert all(layer.self_attn.attn.sliding_window is None for layer in loaded.model.model.layers)
    assert loaded.model.has_cpu_decoder_structure()
    calls = []

    def spy(kernel):
        def call(*args, **kwargs):
            calls.append(sorted(kwargs))
            return kernel(*args, **kwargs)
        return call

    monkeypatch.setattr(ops, "paged_attention", spy(ops.paged_attention))
    monkeypatch.setattr(ops, "paged_prefill_attention", spy(ops.paged_prefill_attention))
    loaded.model.use_cpu_decoder = False  # the Python layers, which call ops
    cache = PagedKVCache(loaded.config, block_size=8)
    loaded.model(cache.step({0: list(range(3, 30))}), cache.caches)
    loaded.model(cache.step({0: [5]}), cache.caches)
    assert calls and all(kwargs == ["max_context_len", "out"] for kwargs in calls)


def test_windowed_logits_over_reference_kernels(windowed, monkeypatch):
    """The model's side of the window, now: over a float64 stand-in for the kernels that
    honours ``sliding_window``, vpage's logits are transformers' past the window (and not
    without the window: the prompts are long enough for it to matter)."""
    folder, hf, _ = windowed
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    _reference_kernels(monkeypatch)
    assert_logits_past_the_window(hf, loaded)
    for layer in loaded.model.model.layers:
        layer.self_attn.attn._options.pop("sliding_window", None)
    with pytest.raises(AssertionError):
        assert_logits_past_the_window(hf, loaded)


@needs_window_kernels
def test_windowed_logits_match_transformers(windowed):
    folder, hf, _ = windowed
    assert_logits_past_the_window(hf, load_model(str(folder), dtype="float32", device="cpu"))


@needs_window_kernels
@pytest.mark.parametrize("setting", setting_params(["plain", "chunked", "prefix", "preempt", "tp2"]))
def test_engine_matches_transformers(windowed, setting):
    """Block size 8 (the harness's) against a 16-token window: a prompt of 37 tokens, a second
    turn of 80, contexts up to 112."""
    folder, hf, _ = windowed
    assert_family_parity(folder, hf, [setting], prompt_len=37)
