"""The engine on a tiny Mistral whose every layer has a sliding window of 16 (blocks of 8): the
block manager frees the blocks before each sequence's window, the context is no longer capped
at the window, and greedy generation past the window equals transformers' (which masks the
same window), under chunked prefill, prefix caching, parallel samples, preemption and n-gram
speculation.

The checks run on the attention kernels (when they have the window: ``sliding_window`` in
``vpage.ops.paged_attention``), and again with a float64 windowed reference attention put in
their place, which fails on any read of a freed (-1) block-table entry (the kernels do not
check those)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import vpage.ops
from model_fixtures import save_tiny_model
from vpage import LLM, SamplingParams

WINDOW, BLOCK = 16, 8
KERNELS_HAVE_WINDOW = "sliding_window" in inspect.signature(vpage.ops.paged_attention).parameters
PROMPTS = [list(range(10, 72)), [3, 5] * 29 + [7], list(range(200, 259))]  # 62, 59 and 59 tokens
# Prompts shorter than the window, admitted for their few blocks: their growth preempts.
SHORT = [list(range(30, 39)), [11] * 10, list(range(120, 132)), [4, 9, 6] * 3]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral_window")
    model = save_tiny_model("mistral", folder, seed=5, sliding_window=WINDOW)
    refs = {}  # prompt -> transformers' greedy tokens
    for prompt in PROMPTS + SHORT:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        refs[tuple(prompt)] = out[0, len(prompt):].tolist()
    return folder, lambda prompts: [refs[tuple(p)] for p in prompts]


def _read_window(key_cache, value_cache, table, first: int, length: int):
    """K/V (float64 [length - first, kv_heads, head_size]) of positions [first, length) through
    the block table; every entry read must be a block (not a freed -1)."""
    bs = key_cache.shape[3]
    blocks = table[first // bs:(length + bs - 1) // bs].long()
    assert bool((blocks >= 0).all()), f"read a freed block-table entry: {table.tolist()}"
    k = key_cache[blocks].double()  # [n, kv, hs / x, bs, x]
    v = value_cache[blocks].double()  # [n, kv, hs, bs]
    n, kv, chunks, _, x = k.shape
    k = k.permute(0, 3, 1, 2, 4).reshape(n * bs, kv, chunks * x)
    v = v.permute(0, 3, 1, 2).reshape(n * bs, kv, chunks * x)
    skip = first - first // bs * bs
    return k[skip:skip + length - first], v[skip:skip + length - first]


def _reference_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc, scale,
                         out, sliding_window):
    """Paged attention in float64 where a query at p sees keys p - W < j <= p (W = sliding_window)."""
    rows = torch.arange(len(context_lens) + 1, dtype=torch.int64) if query_start_loc is None else query_start_loc.long()
    out = torch.empty_like(query) if out is None else out
    for s, length in enumerate(context_lens.tolist()):
        start, end = int(rows[s]), int(rows[s + 1])
        positions = torch.arange(length - (end - start), length)
        first = max(0, int(positions[0]) - sliding_window + 1) if sliding_window else 0
        k, v = _read_window(key_cache, value_cache, block_tables[s], first, length)
        group = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", query[start:end].double(), k) * scale
        keys = torch.arange(first, length)
        hidden = keys[None, :] > positions[:, None]
        if sliding_window:
            hidden |= keys[None, :] <= positions[:, None] - sliding_window
        logits = logits.masked_fill(hidden[None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v).to(out.dtype)
    return out


@pytest.fixture(params=["kernels", "reference attention"])
def attention(request, monkeypatch):
    """The attention the engine runs: the kernels (when they have the window) or the reference
    (on the CPU: it reads the context lengths back, which a captured CUDA graph cannot)."""
    if request.param == "kernels":
        if not KERNELS_HAVE_WINDOW:
            pytest.skip("the attention kernels have no sliding window yet")
        return {}

    def decode(query, key_cache, value_cache, block_tables, context_lens, scale, max_context_len=None, out=None,
               sliding_window=None, logits_soft_cap=None):
        return _reference_attention(query, key_cache, value_cache, block_tables, context_lens, None, scale, out,
                                    sliding_window)

    def prefill(query, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale,
                max_context_len=None, out=None, sliding_window=None, logits_soft_cap=None):
        return _reference_attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                                    scale, out, sliding_window)

    monkeypatch.setattr(vpage.ops, "paged_attention", decode)
    monkeypatch.setattr(vpage.ops, "paged_prefill_attention", prefill)
    return {"device": "cpu"}


def _generate(llm: LLM, prompts, n: int = 1):
    """Greedy tokens of each prompt (each of its n samples) and the most blocks in use at once,
    stepping the engine and checking the scheduler's invariants after every step."""
    engine = llm.engine
    # n samples of top-k 1: each one greedy, written into blocks of its own after the prompt.
    params = (SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True) if n == 1 else
              SamplingParams(temperature=1.0, top_k=1, max_tokens=NEW_TOKENS, ignore_eos=True, n=n, seed=0))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done, peak = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = [c.token_ids for c in output.outputs]
        usage = engine.scheduler.usage()
        peak = max(peak, usage.num_gpu_blocks - usage.free_gpu_blocks)
        engine.scheduler.check_invariants()
    usage = engine.scheduler.usage()
    assert usage.free_gpu_blocks == usage.num_gpu_blocks
    return [done[str(i)] for i in range(len(prompts))], peak


def _llm(folder, attention, **kwargs) -> LLM:
    args = dict(dtype="float32", kv_cache_memory=0.01, block_size=BLOCK, **attention)
    args.update(kwargs)
    return LLM(str(folder), **args)


def test_window_reaches_the_scheduler_and_lifts_the_context_cap(tiny_mistral, attention):
    folder, _ = tiny_mistral
    llm = _llm(folder, attention)
    assert llm.engine.config.cache.sliding_window == WINDOW
    assert llm.engine.scheduler.block_config.sliding_window == WINDOW
    assert llm.engine.max_model_len == 256  # max_position_embeddings, not the window


def test_greedy_past_the_window_matches_transformers(tiny_mistral, attention):
    folder, refs = tiny_mistral
    tokens, _ = _generate(_llm(folder, attention), PROMPTS)
    assert [t[0] for t in tokens] == refs(PROMPTS)


def test_chunked_prefill_holds_the_window_and_a_chunk(tiny_mistral, attention):
    folder, refs = tiny_mistral
    budget = 16
    tokens, peak = _generate(_llm(folder, attention, max_num_batched_tokens=budget), PROMPTS[:1])
    assert tokens[0] == refs(PROMPTS[:1])
    # One sequence: at most ceil((W - 1 + budget) / block_size) + 1 blocks, not its 102 tokens' 13.
    assert peak <= math.ceil((WINDOW - 1 + budget) / BLOCK) + 1 < math.ceil((len(PROMPTS[0]) + NEW_TOKENS) / BLOCK)


def test_prefix_cache_samples_and_preemption_keep_the_tokens(tiny_mistral, attention):
    folder, refs = tiny_mistral
    llm = _llm(folder, attention, max_num_batched_tokens=24)
    first, _ = _generate(llm, PROMPTS[:1])
    again, _ = _generate(llm, PROMPTS[:1], n=2)  # the prompt's blocks come from the prefix cache
    ref = refs(PROMPTS[:1])[0]
    assert first[0] == [ref] and again[0] == [ref, ref]
    assert llm.engine.scheduler.stats.num_cached_prompt_tokens > 0
    for mode in ("recompute", "swap"):
        tight = _llm(folder, attention, max_num_batched_tokens=16, preemption_mode=mode, max_model_len=128,
                     kv_cache_memory=10 * 4096 / 2**30)  # 10 blocks of 4 KiB
        tokens, _ = _generate(tight, SHORT)
        assert [t[0] for t in tokens] == refs(SHORT), mode
        stats = tight.engine.get_stats()
        assert stats.num_preempted_recompute + stats.num_preempted_swap > 0, mode


def test_ngram_speculation_past_the_window(tiny_mistral, attention):
    """Drafts on a windowed model: verified tokens alone move the window (release its blocks),
    rejected drafts' lookahead blocks come back, and the tokens stay transformers' greedy ones,
    also when growth preempts. A draft model is refused here (its KV lives in released blocks)."""
    folder, refs = tiny_mistral
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    budget = 16
    llm = _llm(folder, attention, speculative_config=spec, max_num_batched_tokens=budget)
    tokens, peak = _generate(llm, PROMPTS[:2])
    assert [t[0] for t in tokens] == refs(PROMPTS[:2])
    stats = llm.engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert peak <= 2 * (math.ceil((WINDOW - 1 + budget) / BLOCK) + 1)
    tight = _llm(folder, attention, speculative_config=spec, max_num_batched_tokens=16, preemption_mode="recompute",
                 max_model_len=128, kv_cache_memory=10 * 4096 / 2**30)
    tokens, _ = _generate(tight, SHORT)
    assert [t[0] for t in tokens] == refs(SHORT)
    stats = tight.engine.get_stats()
    assert stats.num_preempted_recompute > 0 and stats.spec_decode_num_accepted_tokens > 0
    drafted = _llm(folder, attention, speculative_config={"model": str(folder), "num_speculative_tokens": 2})
    assert drafted.engine.config.speculative is None
