"""CUDA kernels through vpage.ops against a float64 reference and the CPU twin.

Everything marked ``cuda`` is skipped unless torch sees a GPU and vpage._cuda reports one.
The float64 reference here gathers K/V through the block table and runs plain attention.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from device_marks import cuda_ready, requires_cuda

try:
    from vpage import _cuda
except ImportError:
    _cuda = None


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: (2e-4, 2e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (2e-2, 3e-2)}
CONTEXTS = [1, 17, 54, 97, 1030]


def test_module_imports_without_gpu():
    """vpage._cuda imports everywhere it was built; without a device it reports False."""
    if _cuda is None:
        pytest.skip("vpage built without CUDA")
    assert _cuda.is_available() == (_cuda.device_count() > 0)
    if not os.path.exists("/dev/nvidiactl"):
        assert _cuda.is_available() is False
        assert _cuda.device_count() == 0


# ---------------------------------------------------------------------------------------
# Helpers: caches with NaN outside the written tokens, block tables, float64 reference.


def _ops():
    return pytest.importorskip("vpage.ops")


def _make_kv(context_lens, num_kv_heads, head_size, block_size, dtype, device, seed=0):
    """Random caches whose slots past each context (and unused blocks) hold NaN, so a
    kernel that lets them into a sum fails. Returns key_cache, value_cache, block_tables."""
    g = torch.Generator().manual_seed(seed)
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    key_cache = torch.full((num_blocks, num_kv_heads, head_size // x, block_size, x), float("nan"))
    value_cache = torch.full((num_blocks, num_kv_heads, head_size, block_size), float("nan"))
    used = 0
    for s, (n, nb) in enumerate(zip(context_lens, blocks_per_seq)):
        block_tables[s, :nb] = perm[used:used + nb]
        used += nb
        for pos in range(n):
            b, off = int(block_tables[s, pos // block_size]), pos % block_size
            key_cache[b, :, :, off, :] = torch.randn(num_kv_heads, head_size // x, x, generator=g)
            value_cache[b, :, :, off] = torch.randn(num_kv_heads, head_size, generator=g)
    return (key_cache.to(dtype).to(device), value_cache.to(dtype).to(device), block_tables.to(device))


def _gather(key_cache, value_cache, block_table, n):
    _, num_kv_heads, packs, block_size, x = key_cache.shape
    blocks = block_table[: math.ceil(n / block_size)].long().cpu()
    k = key_cache.cpu()[blocks].double().permute(0, 3, 1, 2, 4).reshape(-1, num_kv_heads, packs * x)[:n]
    v = value_cache.cpu()[blocks].double().permute(0, 3, 1, 2).reshape(-1, num_kv_heads, packs * x)[:n]
    return k, v


def _reference(query, key_cache, value_cache, block_tables, context_lens, query_start_loc, scale):
    """float64 attention; query rows of a sequence are the last tokens of its context."""
    q = query.double().cpu()
    out = torch.zeros_like(q)
    lens = context_lens.cpu().tolist()
    starts = (query_start_loc.cpu().tolist() if query_start_loc is not None else list(range(len(lens) + 1)))
    group = q.shape[1] // key_cache.shape[1]
    for s, n in enumerate(lens):
        first, last = starts[s], starts[s + 1]
        if last == first:
            continue
        k, v = _gather(key_cache, value_cache, block_tables[s], n)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,thd->hqt", q[first:last], k) * scale
        q_len = last - first
        visible = torch.arange(n)[None, :] <= (n - q_len + torch.arange(q_len))[:, None]
        logits = logits.masked_fill(~visible[None], float("-inf"))
        out[first:last] = torch.einsum("hqt,thd->qhd", torch.softmax(logits, dim=-1), v)
    return out


def _assert_close(actual, expected, dtype):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


def _cpu_or_skip(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, TypeError, ValueError, RuntimeError) as err:
        pytest.skip(f"CPU twin unavailable for this case: {err}")


# ---------------------------------------------------------------------------------------
# Attention


@requires_cuda
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1), (12, 6), (20, 2)])
def test_decode_attention(version, dtype, block_size, head_size, num_heads, num_kv_heads):
    ops = _ops()
    from vpage import _ops_cuda

    dev = torch.device("cuda")
    key_cache, value_cache, block_tables = _make_kv(CONTEXTS, num_kv_heads, head_size, block_size, dtype, dev)
    context_lens = torch.tensor(CONTEXTS, dtype=torch.int32, device=dev)
    query = torch.randn(len(CONTEXTS), num_heads, head_size, dtype=dtype, device=dev)
    scale = head_size ** -0.5
    with _ops_cuda.attention_version(version):
        out = ops.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
    torch.cuda.synchronize()
    expected = _reference(query, key_cache, value_cache, block_tables, context_lens, None, scale)
    _assert_close(out, expected, dtype)



@requires_cuda
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [80, 96, 256])
def test_decode_other_head_sizes(version, dtype, head_size):
    ops = _ops()
    from vpage import _ops_cuda

    dev = torch.device("cuda")
    contexts = [3, 600]
    key_cache, value_cache, block_tables = _make_kv(contexts, 2, head_size, 16, dtype, dev, seed=1)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=dev)
    query = torch.randn(2, 6, head_size, dtype=dtype, device=dev)
    with _ops_cuda.attention_version(version):
        out = ops.paged_attention(query, key_cache, value_cache, block_tables, context_lens, 0.1)
    _assert_close(out, _reference(query, key_cache, value_cache, block_tables, context_lens, None, 0.1), dtype)



@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_long_context_auto_and_strided_query(dtype, block_size):
    """Contexts past 8k (the heuristic takes v2) with a query slice of a fused qkv tensor."""
    ops = _ops()
    dev = torch.device("cuda")
    contexts = [9000, 4100]
    key_cache, value_cache, block_tables = _make_kv(contexts, 2, 64, block_size, dtype, dev, seed=2)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=dev)
    qkv = torch.randn(2, 8 + 2 * 2, 64, dtype=dtype, device=dev)
    query = qkv[:, :8]
    out = ops.paged_attention(query, key_cache, value_cache, block_tables, context_lens, 0.125,
                              max_context_len=9000)
    _assert_close(out, _reference(query, key_cache, value_cache, block_tables, context_lens, None, 0.125), dtype)



@requires_cuda
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_decode_matches_cpu_twin(version, dtype, block_size, num_heads, num_kv_heads):
    ops = _ops()
    from vpage import _ops_cuda

    dev = torch.device("cuda")
    key_cache, value_cache, block_tables = _make_kv(CONTEXTS, num_kv_heads, 64, block_size, dtype, dev, seed=3)
    context_lens = torch.tensor(CONTEXTS, dtype=torch.int32, device=dev)
    query = torch.randn(len(CONTEXTS), num_heads, 64, dtype=dtype, device=dev)
    with _ops_cuda.attention_version(version):
        out = ops.paged_attention(query, key_cache, value_cache, block_tables, context_lens, 0.125)
    cpu = _cpu_or_skip(ops.paged_attention, query.cpu(), key_cache.cpu(), value_cache.cpu(),
                       block_tables.cpu(), context_lens.cpu(), 0.125)
    _assert_close(out, cpu, dtype)



@requires_cuda
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1), (12, 6), (20, 2)])
def test_prefill_attention(version, dtype, block_size, head_size, num_heads, num_kv_heads):
    """Whole prompts, chunked prefill over cached blocks, a decode-like row, a long chunk."""
    ops = _ops()
    from vpage import _ops_cuda

    dev = torch.device("cuda")
    contexts = [17, 54, 97, 1, 1030]
    query_lens = [17, 5, 1, 1, 70]
    key_cache, value_cache, block_tables = _make_kv(contexts, num_kv_heads, head_size, block_size, dtype, dev, seed=4)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=dev)
    query_start_loc = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32, device=dev)
    query = torch.randn(sum(query_lens), num_heads, head_size, dtype=dtype, device=dev)
    scale = head_size ** -0.5
    with _ops_cuda.attention_version(version):
        out = ops.paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                                          context_lens, scale)
    expected = _reference(query, key_cache, value_cache, block_tables, context_lens, query_start_loc, scale)
    _assert_close(out, expected, dtype)
    cpu = _cpu_or_skip(ops.paged_prefill_attention, query.cpu(), key_cache.cpu(), value_cache.cpu(),
                       block_tables.cpu(), query_start_loc.cpu(), context_lens.cpu(), scale)
    _assert_close(out, cpu, dtype)



# ---------------------------------------------------------------------------------------
# Cache writes, copies and swaps (bit-exact)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reshape_and_cache_matches_cpu_twin(dtype, block_size):
    ops = _ops()
    dev = torch.device("cuda")
    num_tokens, num_kv_heads, head_size, num_blocks = 37, 3, 64, 12
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    qkv = torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_size, dtype=dtype, device=dev)
    key, value = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[5] = -1
    slot_mapping = slots.to(torch.int64).to(dev)
    key_cache = torch.zeros(num_blocks, num_kv_heads, head_size // x, block_size, x, dtype=dtype, device=dev)
    value_cache = torch.zeros(num_blocks, num_kv_heads, head_size, block_size, dtype=dtype, device=dev)
    cpu_key_cache, cpu_value_cache = key_cache.cpu(), value_cache.cpu()
    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, off = divmod(slot, block_size)
        assert torch.equal(key_cache[b, :, :, off, :].reshape(num_kv_heads, head_size), key[t])
        assert torch.equal(value_cache[b, :, :, off], value[t])
    _cpu_or_skip(ops.reshape_and_cache, key.cpu(), value.cpu(), cpu_key_cache, cpu_value_cache, slot_mapping.cpu())
    assert torch.equal(key_cache.cpu(), cpu_key_cache)
    assert torch.equal(value_cache.cpu(), cpu_value_cache)



@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_all_layers(dtype):
    ops = _ops()
    dev = torch.device("cuda")
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    key_caches = [torch.randn(10, 2, 64 // x, 16, x, device=dev).to(dtype) for _ in range(3)]
    value_caches = [torch.randn(10, 2, 64, 16, device=dev).to(dtype) for _ in range(3)]
    expected_k = [k.clone() for k in key_caches]
    expected_v = [v.clone() for v in value_caches]
    mapping = torch.tensor([[0, 7], [3, 8], [3, 9], [5, 1]], dtype=torch.int64)
    for caches in (expected_k, expected_v):
        for c in caches:
            c[mapping[:, 1]] = c[mapping[:, 0]]
    ops.copy_blocks(key_caches, value_caches, mapping)
    for got, want in zip(key_caches + value_caches, expected_k + expected_v):
        assert torch.equal(got, want)



@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_round_trip_pinned(dtype):
    ops = _ops()
    dev = torch.device("cuda")
    gpu = torch.randn(16, 4, 64, 16, device=dev).to(dtype)
    host = torch.zeros(12, 4, 64, 16, dtype=dtype).pin_memory()
    out_map = torch.tensor([[3, 0], [4, 1], [5, 2], [9, 7], [1, 11]], dtype=torch.int64)
    ops.swap_blocks(gpu, host, out_map)
    torch.cuda.synchronize()
    for src, dst in out_map.tolist():
        assert torch.equal(host[dst], gpu[src].cpu())
    back = torch.zeros_like(gpu)
    in_map = torch.tensor([[0, 10], [1, 11], [2, 12], [7, 2], [11, 0]], dtype=torch.int64)
    ops.swap_blocks(host, back, in_map)
    torch.cuda.synchronize()
    for (src, _), (_, dst) in zip(out_map.tolist(), in_map.tolist()):
        assert torch.equal(back[dst], gpu[src])



# ---------------------------------------------------------------------------------------
# Tiled prefill (one thread block per query tile x KV head group) against the float64
# reference of kv_reference.py. Inputs are uniform in [-1, 1) (never zero); cache slots past
# each context and unused blocks hold NaN; outputs are NaN before the kernel runs.

# (context_len, query_len): whole prompts and chunked prefill over cached tokens, around the
# 64-token KV tiles, the 64-row query tiles and the block sizes; 1..4100.
PREFILL_SEQS = [(1, 1), (17, 17), (64, 64), (65, 65), (100, 37), (300, 1), (777, 200), (4100, 67)]


def _poisoned_prefill_case(seqs, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0):
    """Caches (NaN outside the written tokens), block tables, lens and a query on the GPU."""
    from kv_reference import make_block_tables, make_random_cache

    g = torch.Generator().manual_seed(seed)
    contexts = [c for c, _ in seqs]
    query_lens = [q for _, q in seqs]
    num_blocks = sum(math.ceil(c / block_size) for c in contexts) + 5
    key_cache, value_cache = make_random_cache(num_blocks, num_kv_heads, head_size, block_size, dtype, generator=g)
    block_tables = make_block_tables(contexts, block_size, num_blocks, generator=g)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for s, n in enumerate(contexts):
        for i in range(math.ceil(n / block_size)):
            written[block_tables[s, i], : min(block_size, n - i * block_size)] = True
    key_cache.masked_fill_(~written[:, None, None, :, None], float("nan"))
    value_cache.masked_fill_(~written[:, None, None, :], float("nan"))
    dev = torch.device("cuda")
    query = (torch.rand(sum(query_lens), num_heads, head_size, generator=g) * 2 - 1).to(dtype)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return dict(query=query.to(dev), key_cache=key_cache.to(dev), value_cache=value_cache.to(dev),
                block_tables=block_tables.to(dev), query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
                context_lens=torch.tensor(contexts, dtype=torch.int32, device=dev))


def _run_prefill(case, scale, version="tiled", out=None):
    ops = _ops()
    from vpage import _ops_cuda

    if out is None:
        out = torch.full_like(case["query"], float("nan"))
    with _ops_cuda.attention_version(version):
        ops.paged_prefill_attention(case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
                                    case["query_start_loc"], case["context_lens"], scale, out=out)
    torch.cuda.synchronize(out.device)
    return out


def _prefill_expected(case, scale):
    from kv_reference import reference_prefill_attention

    return reference_prefill_attention(case["query"].cpu(), case["key_cache"].cpu(), case["value_cache"].cpu(),
                                       case["block_tables"].cpu(), case["query_start_loc"].cpu(),
                                       case["context_lens"].cpu(), scale)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_tiled_prefill_matches_reference(dtype, block_size, head_size, num_heads, num_kv_heads):
    case = _poisoned_prefill_case(PREFILL_SEQS, num_heads, num_kv_heads, head_size, block_size, dtype, seed=5)
    scale = head_size ** -0.5
    out = _run_prefill(case, scale)
    assert not out.isnan().any(), "rows left unwritten or NaN read from the cache"
    _assert_close(out, _prefill_expected(case, scale), dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_prefill_long_whole_prompt(dtype):
    """A 4100-token prompt in one step next to a long chunk of another sequence."""
    case = _poisoned_prefill_case([(4100, 4100), (2500, 1300)], 6, 2, 128, 16, dtype, seed=6)
    out = _run_prefill(case, 128 ** -0.5)
    _assert_close(out, _prefill_expected(case, 128 ** -0.5), dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [80, 96, 256])
def test_tiled_prefill_other_head_sizes(dtype, head_size):
    case = _poisoned_prefill_case([(33, 33), (130, 70), (1, 1)], 6, 2, head_size, 32, dtype, seed=7)
    out = _run_prefill(case, 0.1)
    _assert_close(out, _prefill_expected(case, 0.1), dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_tiled_prefill_group_wider_than_a_tile(dtype):
    """72 query heads on one KV head: a tile holds 64 heads of one query, 2 head chunks."""
    case = _poisoned_prefill_case([(20, 3), (70, 70)], 72, 1, 64, 16, dtype, seed=8)
    out = _run_prefill(case, 0.125)
    _assert_close(out, _prefill_expected(case, 0.125), dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_prefill_strided_unaligned_query_and_empty_rows(dtype):
    """Query as a slice of a fused qkv tensor, then shifted off 16-byte alignment (element
    loads), an unaligned `out`, and a sequence without query tokens in the batch."""
    seqs = [(50, 50), (9, 0), (200, 31)]
    case = _poisoned_prefill_case(seqs, 4, 2, 64, 8, dtype, seed=9)
    n = case["query"].shape[0]
    qkv = torch.full((n, 4 + 2 * 2, 64), float("nan"), dtype=dtype, device="cuda")
    qkv[:, :4] = case["query"]
    expected = _prefill_expected(case, 0.125)
    case["query"] = qkv[:, :4]
    _assert_close(_run_prefill(case, 0.125), expected, dtype)
    flat = torch.full((n * 4 * 64 + 1,), float("nan"), dtype=dtype, device="cuda")
    shifted = flat[1:].view(n, 4, 64)
    shifted.copy_(qkv[:, :4])
    case["query"] = shifted
    out_flat = torch.full((n * 4 * 64 + 1,), float("nan"), dtype=dtype, device="cuda")
    out = _run_prefill(case, 0.125, out=out_flat[1:].view(n, 4, 64))
    _assert_close(out, expected, dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 32])
def test_tiled_prefill_matches_per_row_kernel(dtype, block_size):
    """The tiled and the per-row (v1) kernels are independent implementations."""
    case = _poisoned_prefill_case(PREFILL_SEQS, 8, 2, 128, block_size, dtype, seed=10)
    tiled = _run_prefill(case, 0.09)
    per_row = _run_prefill(case, 0.09, version="v1")
    _assert_close(tiled, per_row, dtype)
    _assert_close(_run_prefill(case, 0.09, version="auto"), tiled, dtype)  # tiled where the GPU can


@requires_cuda
def test_tiled_version_rejects_decode():
    ops = _ops()
    from vpage import _ops_cuda

    case = _poisoned_prefill_case([(10, 1)], 4, 4, 64, 16, torch.float16)
    with _ops_cuda.attention_version("tiled"), pytest.raises(RuntimeError):
        ops.paged_attention(case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
                            case["context_lens"], 0.125)


def _two_gpus() -> bool:
    return cuda_ready() and torch.cuda.device_count() >= 2


@pytest.mark.cuda
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 NVIDIA GPUs and vpage._cuda")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernels_run_on_the_tensors_device(dtype):
    """Tensors on cuda:1 while cuda:0 is current (and a side stream is current on cuda:1):
    every kernel must run on cuda:1 and its current stream."""
    ops = _ops()
    with torch.cuda.device(0):
        case = _poisoned_prefill_case([(40, 40), (300, 20)], 4, 2, 64, 16, dtype, seed=11)
        case = {k: v.to("cuda:1") for k, v in case.items()}
        side = torch.cuda.Stream(device="cuda:1")
        with torch.cuda.stream(side):
            out = torch.full_like(case["query"], float("nan"))
            ops.paged_prefill_attention(case["query"], case["key_cache"], case["value_cache"],
                                        case["block_tables"], case["query_start_loc"], case["context_lens"],
                                        0.125, out=out)
            last = case["query_start_loc"][1:] - 1
            decode_out = ops.paged_attention(case["query"][last], case["key_cache"], case["value_cache"],
                                             case["block_tables"], case["context_lens"], 0.125)
            new_key = case["key_cache"].clone()
            new_value = case["value_cache"].clone()
            rows = torch.rand(3, 2, 64, device="cuda:1").to(dtype)
            ops.reshape_and_cache(rows, rows, new_key, new_value,
                                  torch.tensor([0, 5, 17], dtype=torch.int64, device="cuda:1"))
            ops.copy_blocks([new_key], [new_value], torch.tensor([[0, 1]], dtype=torch.int64))
        side.synchronize()
    expected = _prefill_expected(case, 0.125)
    _assert_close(out, expected, dtype)
    _assert_close(decode_out, expected[last.cpu()], dtype)
    assert torch.equal(new_key[0, :, :, 5].reshape(2, 64), rows[1])
    for cache in (new_key, new_value):  # bitwise: the blocks hold NaN poison too
        assert torch.equal(cache[1].view(torch.uint8), cache[0].view(torch.uint8))


# ---------------------------------------------------------------------------------------
# Sliding window and attention-logit soft cap, against kv_reference.py's float64 reference
# and the CPU twin; blocks wholly before the window are poisoned with NaN (and their table
# entries set to -1) and must not change the result.

WINDOW_CAP = 2.5  # scores are about N(0, 1) here: the cap bends the larger ones
# (window, cap): below a block, not a multiple of the block size, across partitions (700),
# >= every context, the cap alone and with a window.
WINDOW_CASES = [(5, None), (13, None), (16, WINDOW_CAP), (700, None), (None, WINDOW_CAP), (100000, None)]
# (context_len, query_len) for the prefill cases; decode uses one query per context.
WINDOW_SEQS = [(1, 1), (17, 17), (54, 5), (97, 1), (300, 300), (1030, 200), (2100, 67)]


def _window_run(case, version, window, cap, decode, scale):
    ops = _ops()
    from vpage import _ops_cuda

    with _ops_cuda.attention_version(version):
        if decode:
            last = case["query_start_loc"][1:] - 1
            out = ops.paged_attention(case["query"][last], case["key_cache"], case["value_cache"],
                                      case["block_tables"], case["context_lens"], scale, sliding_window=window,
                                      logits_soft_cap=cap)
        else:
            out = ops.paged_prefill_attention(case["query"], case["key_cache"], case["value_cache"],
                                              case["block_tables"], case["query_start_loc"], case["context_lens"],
                                              scale, sliding_window=window, logits_soft_cap=cap)
    torch.cuda.synchronize(out.device)
    return out


def _check_window(case, version, window, cap, decode, dtype, scale=0.11):
    """GPU vs float64 reference and CPU twin; then poisoned / freed blocks give the same bits."""
    from kv_reference import free_blocks_before_window, reference_prefill_attention

    ops = _ops()
    out = _window_run(case, version, window, cap, decode, scale)
    cpu = {k: v.cpu() for k, v in case.items()}
    expected = reference_prefill_attention(cpu["query"], cpu["key_cache"], cpu["value_cache"], cpu["block_tables"],
                                           cpu["query_start_loc"], cpu["context_lens"], scale,
                                           sliding_window=window, logits_soft_cap=cap)
    last = cpu["query_start_loc"][1:] - 1
    if decode:
        expected = expected[last]
    _assert_close(out, expected, dtype)
    if decode:
        twin = ops.paged_attention(cpu["query"][last], cpu["key_cache"], cpu["value_cache"], cpu["block_tables"],
                                   cpu["context_lens"], scale, sliding_window=window, logits_soft_cap=cap)
    else:
        twin = ops.paged_prefill_attention(cpu["query"], cpu["key_cache"], cpu["value_cache"], cpu["block_tables"],
                                           cpu["query_start_loc"], cpu["context_lens"], scale,
                                           sliding_window=window, logits_soft_cap=cap)
    _assert_close(out, twin, dtype)
    query_lens = None if decode else (cpu["query_start_loc"][1:] - cpu["query_start_loc"][:-1]).tolist()
    kc, vc, freed_table, dead = free_blocks_before_window(case["key_cache"], case["value_cache"],
                                                          case["block_tables"], cpu["context_lens"].tolist(),
                                                          query_lens, window)
    if dead:
        for table in (case["block_tables"], freed_table):
            poisoned = dict(case, key_cache=kc, value_cache=vc, block_tables=table)
            assert torch.equal(_window_run(poisoned, version, window, cap, decode, scale), out)
    return dead


@requires_cuda
@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(64, 6, 2), (80, 4, 4)])
def test_window_decode(version, dtype, block_size, head_size, num_heads, num_kv_heads):
    case = _poisoned_prefill_case([(c, 1) for c, _ in WINDOW_SEQS], num_heads, num_kv_heads, head_size, block_size,
                                  dtype, seed=12)
    assert sum(_check_window(case, version, w, c, True, dtype) for w, c in WINDOW_CASES) > 0


@requires_cuda
@pytest.mark.parametrize("version", ["tiled", "v1", "v2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads", [(64, 6, 2), (80, 4, 4)])
def test_window_prefill(version, dtype, block_size, head_size, num_heads, num_kv_heads):
    case = _poisoned_prefill_case(WINDOW_SEQS, num_heads, num_kv_heads, head_size, block_size, dtype, seed=13)
    assert sum(_check_window(case, version, w, c, False, dtype) for w, c in WINDOW_CASES) > 0


@requires_cuda
@pytest.mark.parametrize("version", ["tiled", "v2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [128, 256])
def test_window_large_heads(version, dtype, head_size):
    case = _poisoned_prefill_case([(130, 45), (600, 600)], 8, 2, head_size, 16, dtype, seed=14)
    for w, c in [(20, None), (100, WINDOW_CAP), (None, WINDOW_CAP)]:
        _check_window(case, version, w, c, False, dtype)
        if version == "v2":
            _check_window(case, version, w, c, True, dtype)
