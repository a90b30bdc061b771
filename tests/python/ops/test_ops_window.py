"""Sliding-window attention and attention-logit soft-capping of vpage.ops on CPU tensors,
against the float64 reference in kv_reference.py (every ISA build, several thread counts).

Besides the values, the tests check which blocks the kernels read: blocks wholly before the
window of a sequence's earliest query are poisoned with NaN (and, separately, their table
entries set to -1, as the block manager does once it frees them); the result must not change.
"""

import math

import pytest
import torch

from kv_reference import (free_blocks_before_window, make_block_tables, make_random_cache,
                          reference_paged_attention, reference_prefill_attention)
from vpage import _core, ops

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
CAP = 4.0  # soft cap: scores reach about +-4 with SCALE below, so tanh bends them
SCALE = 0.5


def available_isas():
    isas = []
    for isa in ("generic", "avx2", "avx512"):
        try:
            _core.set_cpu_isa(isa)
            isas.append(isa)
        except ValueError:
            pass
    _core.set_cpu_isa("auto")
    return isas


ISAS = available_isas()


@pytest.fixture
def isa(request):
    _core.set_cpu_isa(request.param)
    yield request.param
    _core.set_cpu_isa("auto")


@pytest.fixture
def threads():
    """Sets the kernels' thread count inside a test; restores the default afterwards."""
    yield ops.set_num_threads
    ops.set_num_threads(None)


def make_case(seed, contexts, queries, num_heads, num_kv_heads, head_size, block_size, cache_dtype,
              act_dtype=None):
    """Random caches (NaN in every slot past the contexts), shuffled tables and queries.
    queries None: decode (one query per sequence), else query tokens per sequence."""
    gen = torch.Generator().manual_seed(seed)
    needed = [(n + block_size - 1) // block_size for n in contexts]
    num_blocks = sum(needed) + 3
    key_cache, value_cache = make_random_cache(num_blocks, num_kv_heads, head_size, block_size, cache_dtype,
                                               generator=gen)
    tables = make_block_tables(contexts, block_size, num_blocks, generator=gen)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for s, n in enumerate(contexts):
        for t in range(n):
            used[tables[s, t // block_size], t % block_size] = True
    blocks, offsets = (~used).nonzero(as_tuple=True)
    key_cache[blocks, :, :, offsets, :] = float("nan")
    value_cache[blocks, :, :, offsets] = float("nan")
    tokens = len(contexts) if queries is None else sum(queries)
    query = (torch.rand((tokens, num_heads, head_size), generator=gen) * 2 - 1).to(act_dtype or cache_dtype)
    starts = None
    if queries is not None:
        starts = torch.tensor([0] + list(queries), dtype=torch.int32).cumsum(0).to(torch.int32)
    return query, key_cache, value_cache, tables, torch.tensor(contexts, dtype=torch.int32), starts


def run(query, kc, vc, tables, lens, starts, window, cap):
    if starts is None:
        return ops.paged_attention(query, kc, vc, tables, lens, SCALE, sliding_window=window, logits_soft_cap=cap)
    return ops.paged_prefill_attention(query, kc, vc, tables, starts, lens, SCALE, sliding_window=window,
                                       logits_soft_cap=cap)


def reference(query, kc, vc, tables, lens, starts, window, cap):
    if starts is None:
        return reference_paged_attention(query, kc, vc, tables, lens, SCALE, sliding_window=window,
                                         logits_soft_cap=cap)
    return reference_prefill_attention(query, kc, vc, tables, starts, lens, SCALE, sliding_window=window,
                                       logits_soft_cap=cap)


def check_case(case, contexts, queries, window, cap, dtype):
    """Kernel vs float64 reference, then the same result with freed blocks (bitwise)."""
    query, kc, vc, tables, lens, starts = case
    out = run(query, kc, vc, tables, lens, starts, window, cap)
    assert not torch.isnan(out).any()
    ref = reference(query, kc, vc, tables, lens, starts, window, cap)
    err = (out.double() - ref).abs().max().item()
    assert err <= TOLERANCE[dtype], f"window {window}, cap {cap}: max error {err}"
    poisoned_kc, poisoned_vc, minus_one, dead = free_blocks_before_window(kc, vc, tables, contexts, queries, window)
    if dead:
        # The intact table over poisoned blocks: any read of them would bring NaN in.
        same_table = run(query, poisoned_kc, poisoned_vc, tables, lens, starts, window, cap)
        assert torch.equal(same_table, out), f"window {window}: a block before the window was read"
        freed_table = run(query, poisoned_kc, poisoned_vc, minus_one, lens, starts, window, cap)
        assert torch.equal(freed_table, out), f"window {window}: -1 table entries changed the result"
    return dead


# Windows: smaller than a block, not a multiple of the block size, a multiple, and >= every
# context (the same as none); caps alone and with a window.
WINDOWS = [(1, None), (5, None), (13, None), (16, None), (40, CAP), (None, CAP), (100000, None)]


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(64, 8, 2), (80, 3, 3)])
def test_decode(isa, dtype, block_size, head_size, num_heads, num_kv_heads):
    contexts = [1, 7, 17, 54, 97, 200]
    case = make_case(1, contexts, None, num_heads, num_kv_heads, head_size, block_size, dtype)
    dead = sum(check_case(case, contexts, None, w, c, dtype) for w, c in WINDOWS)
    assert dead > 0  # some case really freed blocks


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(64, 8, 2), (80, 3, 3)])
def test_prefill(isa, dtype, block_size, head_size, num_heads, num_kv_heads):
    """Whole prompts, chunks after a cached prefix (queries are the last tokens of a longer
    context) and single-query sequences (the decode kernel inside a prefill batch)."""
    contexts = [30, 77, 150, 61, 9]
    queries = [30, 20, 64, 1, 9]
    case = make_case(2, contexts, queries, num_heads, num_kv_heads, head_size, block_size, dtype)
    dead = sum(check_case(case, contexts, queries, w, c, dtype) for w, c in WINDOWS)
    assert dead > 0


@pytest.mark.parametrize("head_size", [128, 256])
@pytest.mark.parametrize("prefill", [False, True])
def test_large_heads(head_size, prefill):
    contexts = [45, 130]
    queries = [45, 40] if prefill else None
    case = make_case(3, contexts, queries, 4, 2, head_size, 16, torch.bfloat16)
    for w, c in [(20, None), (33, CAP), (None, CAP)]:
        check_case(case, contexts, queries, w, c, torch.bfloat16)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefill", [False, True])
def test_float32_activations_16bit_cache(cache_dtype, prefill):
    contexts = [70, 33]
    queries = [25, 33] if prefill else None
    case = make_case(4, contexts, queries, 6, 2, 64, 16, cache_dtype, act_dtype=torch.float32)
    for w, c in [(10, None), (17, CAP), (None, CAP)]:
        check_case(case, contexts, queries, w, c, cache_dtype)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_threads(threads, num_threads, dtype):
    """Long decode contexts with few sequences: with several threads the window's span is
    cut into partitions, which must start at the window's first block."""
    threads(num_threads)
    contexts = [2000, 1500, 300]
    case = make_case(5, contexts, None, 2, 1, 64, 16, dtype)
    for w, c in [(700, None), (1100, CAP), (None, CAP), (9, None)]:
        assert check_case(case, contexts, None, w, c, dtype) > 0 or w is None
    prefill_contexts, prefill_queries = [1200, 500], [150, 500]
    case = make_case(6, prefill_contexts, prefill_queries, 2, 1, 64, 16, dtype)
    for w, c in [(300, None), (64, CAP)]:
        assert check_case(case, prefill_contexts, prefill_queries, w, c, dtype) > 0


def test_cap_and_window_matter():
    """The reference's window and cap change the answer (so the tests above can fail)."""
    contexts = [120]
    query, kc, vc, tables, lens, _ = make_case(7, contexts, None, 2, 1, 64, 16, torch.float32)
    plain = reference(query, kc, vc, tables, lens, None, None, None)
    assert (reference(query, kc, vc, tables, lens, None, 40, None) - plain).abs().max() > 1e-2
    assert (reference(query, kc, vc, tables, lens, None, None, CAP) - plain).abs().max() > 1e-3
    out = ops.paged_attention(query, kc, vc, tables, lens, SCALE, sliding_window=120)
    torch.testing.assert_close(out.double(), plain, atol=2e-5, rtol=0)


def test_trusted_arguments_same_result():
    contexts, queries = [90, 40], [30, 40]
    query, kc, vc, tables, lens, starts = make_case(8, contexts, queries, 4, 2, 64, 16, torch.float32)
    checked = run(query, kc, vc, tables, lens, starts, 21, CAP)
    with ops.trusted_arguments():
        trusted = run(query, kc, vc, tables, lens, starts, 21, CAP)
    assert torch.equal(checked, trusted)


def test_table_entries_inside_window_checked():
    """Only entries before the window may be invalid: a -1 inside it is an error."""
    contexts = [100]
    query, kc, vc, tables, lens, _ = make_case(9, contexts, None, 2, 1, 64, 16, torch.float32)
    bad = tables.clone()
    bad[0, 0:3] = -1  # blocks 0-2: before the window of 30 keys ending at 99 (starts at 70)
    ops.paged_attention(query, kc, vc, bad, lens, SCALE, sliding_window=30)
    bad[0, 4] = -1  # block 4 holds key 70, the window's first
    with pytest.raises(Exception, match="block id -1"):
        ops.paged_attention(query, kc, vc, bad, lens, SCALE, sliding_window=30)
    with pytest.raises(Exception, match="block id -1"):
        ops.paged_attention(query, kc, vc, bad, lens, SCALE)


@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("kwargs,error", [
    (dict(sliding_window=0), ValueError), (dict(sliding_window=-4), ValueError),
    (dict(sliding_window=2.0), TypeError), (dict(sliding_window=True), TypeError),
    (dict(sliding_window="8"), TypeError), (dict(logits_soft_cap=float("nan")), ValueError),
    (dict(logits_soft_cap=-1.0), ValueError), (dict(logits_soft_cap=0.0), ValueError),
    (dict(logits_soft_cap=float("inf")), ValueError), (dict(logits_soft_cap="50"), TypeError),
])
def test_argument_errors(prefill, kwargs, error):
    contexts = [20]
    query, kc, vc, tables, lens, starts = make_case(10, contexts, [20] if prefill else None, 2, 1, 64, 16,
                                                    torch.float32)
    name = next(iter(kwargs))
    with pytest.raises(error, match=name):
        if prefill:
            ops.paged_prefill_attention(query, kc, vc, tables, starts, lens, SCALE, **kwargs)
        else:
            ops.paged_attention(query, kc, vc, tables, lens, SCALE, **kwargs)


def test_kernel_checks_without_python():
    """The C++ argument check rejects a negative window or cap that skipped Python's checks."""
    contexts = [20]
    query, kc, vc, tables, lens, _ = make_case(11, contexts, None, 2, 1, 64, 16, torch.float32)
    for kwargs, name in [(dict(sliding_window=-3), "sliding_window"), (dict(logits_soft_cap=-2.0), "logits_soft_cap"),
                         (dict(logits_soft_cap=math.nan), "logits_soft_cap")]:
        with ops.trusted_arguments(), pytest.raises(Exception, match=name):
            ops.paged_attention(query, kc, vc, tables, lens, SCALE, **kwargs)
