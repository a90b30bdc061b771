"""vpage.ops on CPU tensors against the float64 reference in kv_reference.py."""

import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from device_marks import available_isas
from kv_reference import (make_block_tables, make_random_cache, pack_size,
                          reference_paged_attention, reference_prefill_attention)
from vpage import _core, ops

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
CONTEXTS = [1, 17, 54, 97, 1030]


@pytest.mark.parametrize("value", ["generic", "avx2", "no-such-isa"])
def test_cpu_isa_environment_variable(value):
    """VPAGE_CPU_ISA caps the kernels from their first use; a bad value is a clear error."""
    code = ("from vpage import _core\ntry:\n    print(_core.cpu_isa())\nexcept ValueError as e:\n"
            "    print('error:', e)\n")
    env = dict(os.environ, VPAGE_CPU_ISA=value)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if value in available_isas():
        assert out.stdout.strip() == value
    else:
        assert out.stdout.startswith("error: VPAGE_CPU_ISA: "), out.stdout
        assert ("unknown instruction set" if value == "no-such-isa" else "does not support") in out.stdout


def poison_unused(key_cache, value_cache, tables, context_lens):
    """NaN in every cache slot that no sequence's context covers."""
    block_size = value_cache.shape[3]
    used = torch.zeros(value_cache.shape[0], block_size, dtype=torch.bool)
    for s, length in enumerate(context_lens):
        for t in range(length):
            used[tables[s, t // block_size], t % block_size] = True
    unused_blocks, unused_offsets = (~used).nonzero(as_tuple=True)
    key_cache[unused_blocks, :, :, unused_offsets, :] = float("nan")
    value_cache[unused_blocks, :, :, unused_offsets] = float("nan")


def setup(seed, contexts, num_heads, num_kv_heads, head_size, block_size, dtype, num_queries=None):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum((n + block_size - 1) // block_size for n in contexts) + 5
    key_cache, value_cache = make_random_cache(num_blocks, num_kv_heads, head_size, block_size, dtype,
                                               generator=gen)
    tables = make_block_tables(contexts, block_size, num_blocks, generator=gen)
    poison_unused(key_cache, value_cache, tables, contexts)
    tokens = len(contexts) if num_queries is None else sum(num_queries)
    query = (torch.rand((tokens, num_heads, head_size), generator=gen) * 2 - 1).to(dtype)
    return query, key_cache, value_cache, tables, torch.tensor(contexts, dtype=torch.int32)


def check_close(out, ref, dtype):
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max error {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_size", [64, 128])
def test_decode(dtype, block_size, group, head_size):
    num_kv_heads = 2 if group < 8 else 1
    query, kc, vc, tables, lens = setup(7, CONTEXTS, group * num_kv_heads, num_kv_heads, head_size,
                                        block_size, dtype)
    scale = 1 / math.sqrt(head_size)
    out = torch.full_like(query, float("nan"))
    result = ops.paged_attention(query, kc, vc, tables, lens, scale, out=out)
    assert result is out
    check_close(out, reference_paged_attention(query, kc, vc, tables, lens, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8, 16])
def test_decode_block_boundaries(dtype, block_size, group):
    """Contexts ending just before, at and after block and 64-token group boundaries, every
    number of rows per task pass (1..4, then passes of 4), NaN in unused slots."""
    contexts = [1, 15, 16, 17, 31, 33, 63, 64, 65, 129, 1000]
    query, kc, vc, tables, lens = setup(13, contexts, group * 2, 2, 64, block_size, dtype)
    out = ops.paged_attention(query, kc, vc, tables, lens, 0.125)
    check_close(out, reference_paged_attention(query, kc, vc, tables, lens, 0.125), dtype)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sharp_softmax_partitions(threads, dtype):
    """A large scale makes the running max jump between groups (accumulator rescaling), and
    one long sequence is split into context partitions when threads > 1."""
    query, kc, vc, tables, lens = setup(17, [1000, 3], 6, 2, 64, 16, dtype)
    ops.set_num_threads(threads)
    try:
        out = ops.paged_attention(query, kc, vc, tables, lens, 2.0)
    finally:
        ops.set_num_threads(None)
    check_close(out, reference_paged_attention(query, kc, vc, tables, lens, 2.0), dtype)


@pytest.mark.parametrize("head_size", [80, 96, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_other_head_sizes(head_size, dtype):
    query, kc, vc, tables, lens = setup(11, [5, 40, 333], 4, 2, head_size, 16, dtype)
    out = ops.paged_attention(query, kc, vc, tables, lens, 0.1, max_context_len=400)
    check_close(out, reference_paged_attention(query, kc, vc, tables, lens, 0.1), dtype)


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_every_instruction_set(isa, dtype, block_size):
    query, kc, vc, tables, lens = setup(3, [1, 54, 1030], 6, 2, 64, block_size, dtype)
    try:
        _core.set_cpu_isa(isa)
        out = ops.paged_attention(query, kc, vc, tables, lens, 0.125)
    finally:
        _core.set_cpu_isa("auto")
    check_close(out, reference_paged_attention(query, kc, vc, tables, lens, 0.125), dtype)


@pytest.fixture(params=["openmp", "own"])
def thread_source(request):
    """Runs a test with the kernels on torch's OpenMP threads, then on vpage's own pool."""
    runtime = ops.set_thread_source(request.param)
    assert (runtime != "") == (request.param == "openmp"), runtime  # torch's libgomp is loaded
    yield request.param
    ops.set_thread_source("openmp")


def test_thread_source_rejects_unknown_names():
    with pytest.raises(ValueError, match="expected 'own' or 'openmp'"):
        ops.set_thread_source("tbb")


def test_long_single_sequence_partitions_and_threads(thread_source):
    query, kc, vc, tables, lens = setup(5, [2500], 8, 1, 128, 16, torch.float32)
    ref = reference_paged_attention(query, kc, vc, tables, lens, 0.09)
    results = []
    for threads in (1, 2, 3):
        ops.set_num_threads(threads)
        try:
            results.append(ops.paged_attention(query, kc, vc, tables, lens, 0.09))
        finally:
            ops.set_num_threads(None)
        check_close(results[-1], ref, torch.float32)
    assert ops.get_num_threads() == torch.get_num_threads()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_kernels_run_in_forked_child(thread_source):
    """The kernels' thread pool is re-created in a fork()ed child (e.g. a DataLoader worker):
    its workers from the parent do not exist there, and an OpenMP team inherited through fork
    is not used (the child goes back to the own pool). The child reports through its exit
    status; alarm() fails it instead of hanging if the pool waits for missing workers."""
    query, kc, vc, tables, lens = setup(5, [300, 97, 54, 17], 6, 2, 64, 16, torch.float32)
    ref = reference_paged_attention(query, kc, vc, tables, lens, 0.125)
    ops.set_num_threads(2)
    try:
        ops.paged_attention(query, kc, vc, tables, lens, 0.125)  # starts the workers
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(20)
                out = ops.paged_attention(query, kc, vc, tables, lens, 0.125)
                code = 0 if (out.double() - ref).abs().max().item() <= TOLERANCE[torch.float32] else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
        check_close(ops.paged_attention(query, kc, vc, tables, lens, 0.125), ref, torch.float32)
    finally:
        ops.set_num_threads(None)


def test_empty_context_gives_zeros():
    query, kc, vc, tables, lens = setup(1, [0, 3], 2, 1, 64, 8, torch.float32)
    out = ops.paged_attention(query, kc, vc, tables, lens, 0.1, out=torch.full_like(query, float("nan")))
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_chunks_after_cached_prefix(dtype, block_size, group):
    contexts = [17, 54, 97, 300, 1]
    num_queries = [17, 5, 33, 1, 1]  # whole prompt, chunks after a cached prefix, decode-like
    num_kv_heads = 2 if group < 8 else 1
    query, kc, vc, tables, lens = setup(13, contexts, group * num_kv_heads, num_kv_heads, 64,
                                        block_size, dtype, num_queries)
    starts = torch.tensor([0] + num_queries, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    ops.paged_prefill_attention(query, kc, vc, tables, starts, lens, 0.125, out=out)
    check_close(out, reference_prefill_attention(query, kc, vc, tables, starts, lens, 0.125), dtype)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_token_beside_prompt_chunks_matches_a_decode_step_bitwise(block_size, group):
    # A decode token scheduled in the same step as another request's prompt gets the decode
    # step's kernel: its attention (one partition, short contexts) is bitwise the same.
    contexts = [40, 21, 9]
    num_queries = [1, 21, 1]  # a decode token, a whole prompt, a decode token
    num_kv_heads = 2
    query, kc, vc, tables, lens = setup(21, contexts, group * num_kv_heads, num_kv_heads, 64, block_size,
                                        torch.float32, num_queries)
    starts = torch.tensor([0] + num_queries, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    mixed = torch.full_like(query, float("nan"))
    ops.paged_prefill_attention(query, kc, vc, tables, starts, lens, 0.125, out=mixed)
    decode_rows = [0, 22]  # the decode tokens' query rows
    for seq, row in zip((0, 2), decode_rows):
        alone = torch.full_like(query[row:row + 1], float("nan"))
        ops.paged_attention(query[row:row + 1].contiguous(), kc, vc, tables[seq:seq + 1].contiguous(),
                            lens[seq:seq + 1].contiguous(), 0.125, out=alone)
        assert torch.equal(alone[0], mixed[row])


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_query_tiles_every_isa(isa, head_size, group, dtype):
    # Query counts around the tile sizes of every ISA (prefill tasks hold 3 SIMD vectors of
    # query rows: 48 rows with AVX-512, 24 otherwise), whole prompts and chunks after a
    # cached prefix, contexts not a multiple of the block size.
    contexts = [16, 49, 100, 203, 33, 250]
    num_queries = [16, 49, 17, 203, 32, 6]
    num_kv_heads = 2 if group < 8 else 1
    query, kc, vc, tables, lens = setup(31, contexts, group * num_kv_heads, num_kv_heads, head_size,
                                        16, dtype, num_queries)
    starts = torch.tensor([0] + num_queries, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    ref = reference_prefill_attention(query, kc, vc, tables, starts, lens, 0.125)
    try:
        _core.set_cpu_isa(isa)
        out = torch.full_like(query, float("nan"))
        ops.paged_prefill_attention(query, kc, vc, tables, starts, lens, 0.125, out=out)
    finally:
        _core.set_cpu_isa("auto")
    check_close(out, ref, dtype)


def test_prefill_strided_query_rows():
    contexts, num_queries = [40, 21], [40, 9]
    query, kc, vc, tables, lens = setup(17, contexts, 6, 2, 64, 16, torch.bfloat16, num_queries)
    fused = torch.zeros((query.shape[0], 10, 64), dtype=torch.bfloat16)
    fused[:, :6] = query
    strided = fused[:, :6]
    starts = torch.tensor([0, 40, 49], dtype=torch.int32)
    out = ops.paged_prefill_attention(strided, kc, vc, tables, starts, lens, 0.125)
    check_close(out, reference_prefill_attention(query, kc, vc, tables, starts, lens, 0.125), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reshape_and_cache_bit_exact(dtype):
    gen = torch.Generator().manual_seed(21)
    num_blocks, num_kv_heads, head_size, block_size, tokens = 6, 2, 64, 8, 20
    kc = torch.zeros(ops.key_cache_shape(num_blocks, num_kv_heads, head_size, block_size, dtype), dtype=dtype)
    vc = torch.zeros(ops.value_cache_shape(num_blocks, num_kv_heads, head_size, block_size, dtype), dtype=dtype)
    qkv = torch.randn((tokens, 3, num_kv_heads, head_size), generator=gen).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]  # strided rows, as sliced from a fused projection
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(torch.int64)
    slots[3] = -1
    ops.reshape_and_cache(key, value, kc, vc, slots)
    x = pack_size(dtype)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, block_size)
        written[b, o] = True
        assert torch.equal(kc[b, :, :, o, :].reshape(num_kv_heads, head_size).view(torch.int16),
                           key[t].reshape(num_kv_heads, head_size).view(torch.int16))
        assert torch.equal(vc[b, :, :, o], value[t])
    unwritten_b, unwritten_o = (~written).nonzero(as_tuple=True)
    assert not kc[unwritten_b, :, :, unwritten_o, :].any() and not vc[unwritten_b, :, :, unwritten_o].any()
    assert kc.shape[-1] == x


def test_copy_and_swap_blocks_bit_exact():
    gen = torch.Generator().manual_seed(4)
    shape_k = ops.key_cache_shape(8, 2, 64, 16, torch.bfloat16)
    shape_v = ops.value_cache_shape(8, 2, 64, 16, torch.bfloat16)
    keys = [torch.randint(-2**15, 2**15, shape_k, generator=gen, dtype=torch.int16).view(torch.bfloat16)
            for _ in range(3)]
    values = [torch.randint(-2**15, 2**15, shape_v, generator=gen, dtype=torch.int16).view(torch.bfloat16)
              for _ in range(3)]
    before_k = [k.clone() for k in keys]
    before_v = [v.clone() for v in values]
    mapping = torch.tensor([[0, 5], [2, 7], [2, 1]], dtype=torch.int64)
    ops.copy_blocks(keys, values, mapping)
    for layer in range(3):
        for src, dst in mapping.tolist():
            assert torch.equal(keys[layer][dst].view(torch.int16), before_k[layer][src].view(torch.int16))
            assert torch.equal(values[layer][dst].view(torch.int16), before_v[layer][src].view(torch.int16))
        assert torch.equal(keys[layer][3].view(torch.int16), before_k[layer][3].view(torch.int16))

    pool = torch.zeros((4,) + shape_k[1:], dtype=torch.bfloat16)
    ops.swap_blocks(keys[0], pool, torch.tensor([[5, 0], [7, 3]], dtype=torch.int64))
    back = torch.zeros_like(keys[0])
    ops.swap_blocks(pool, back, torch.tensor([[0, 5], [3, 7]], dtype=torch.int64))
    for b in (5, 7):
        assert torch.equal(back[b].view(torch.int16), keys[0][b].view(torch.int16))


def test_validation_errors():
    query, kc, vc, tables, lens = setup(2, [10, 20], 4, 2, 64, 16, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        ops.paged_attention(query.half(), kc, vc, tables, lens, 0.1)
    with pytest.raises(TypeError, match="block_tables"):
        ops.paged_attention(query, kc, vc, tables.long(), lens, 0.1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.paged_attention(query[:, :3], kc, vc, tables, lens, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        ops.paged_attention(query, kc, vc.transpose(2, 3), tables, lens, 0.1)
    with pytest.raises(ValueError, match="out shape"):
        ops.paged_attention(query, kc, vc, tables, lens, 0.1, out=torch.empty(2, 4, 32))
    with pytest.raises(ValueError, match="decode query"):
        ops.paged_attention(query[:1], kc, vc, tables, lens, 0.1)
    bad_tables = tables.clone()
    bad_tables[1, 0] = 10_000
    with pytest.raises(ValueError, match="block id 10000 out of range"):
        ops.paged_attention(query, kc, vc, bad_tables, lens, 0.1)
    with pytest.raises(ValueError, match="max_context_len"):
        ops.paged_attention(query, kc, vc, tables, lens, 0.1, max_context_len=5)
    with pytest.raises(ValueError, match="query_start_loc"):
        ops.paged_prefill_attention(query, kc, vc, tables, torch.tensor([0, 2], dtype=torch.int32), lens, 0.1)
    with pytest.raises(ValueError, match="more query tokens"):
        ops.paged_prefill_attention(torch.zeros(12, 4, 64), kc, vc, tables,
                                    torch.tensor([0, 11, 12], dtype=torch.int32), lens, 0.1)
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.reshape_and_cache(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), kc, vc,
                              torch.tensor([kc.shape[0] * 16], dtype=torch.int64))
    with pytest.raises(TypeError, match="slot_mapping"):
        ops.reshape_and_cache(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), kc, vc,
                              torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="out of range"):
        ops.copy_blocks([kc], [vc], torch.tensor([[0, kc.shape[0]]], dtype=torch.int64))
    with pytest.raises(ValueError, match="out of range"):
        ops.swap_blocks(kc, kc.clone(), torch.tensor([[-1, 0]], dtype=torch.int64))
    with pytest.raises(ValueError, match="num_threads"):
        ops.set_num_threads(0)
    with pytest.raises(TypeError, match="unsupported"):
        ops.key_cache_shape(4, 2, 64, 16, torch.int8)
