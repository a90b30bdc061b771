"""vpage.ops.quant_matmul / dequantize_rows: every GGUF block type against a float64 matmul
of gguf's own dequantization, awkward shapes, every instruction set the CPU has, 16-bit
activations, and argument checks."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from device_marks import available_isas
from quant_fixtures import ALL_TYPES, dequantized, quantized_rows
from vpage import _core, ops

ISAS = available_isas()


@pytest.fixture
def isa(request):
    _core.set_cpu_isa(request.param)
    assert _core.quant_matmul_isa() == request.param
    yield request.param
    _core.set_cpu_isa("auto")


def _weights(qtype: str, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    rows = quantized_rows(qtype, rng.standard_normal((n, k)).astype(np.float32), rng)
    return torch.from_numpy(np.ascontiguousarray(rows)), dequantized(qtype, rows)


INTEGER_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")  # x rounded to 8 bits (integer decode and GEMM paths)


def _integer_k(qtype: str, k: int) -> int:
    """k for a test written for 32-value blocks: Q4_K needs whole 256-value super-blocks."""
    return k if qtype != "Q4_K" else (k + 255) // 256 * 256


def _round_x(xf: np.ndarray) -> np.ndarray:
    """x rounded to 8 bits per 32 values as the integer paths round it (d = max|x| / 127,
    q = round(x / d)), written here from that definition, as float64."""
    blocks = xf.reshape(xf.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.maximum(amax, np.float32(1e-30)), np.float32(0))
    q = np.rint(blocks * inv.astype(np.float32))
    rounded = (amax / np.float32(127)).astype(np.float32) * q
    assert 0 < np.abs(rounded - blocks).max() <= amax.max() / 254 * 1.001  # it moved, by at most d / 2
    return rounded.reshape(xf.shape).astype(np.float64)


def _as_multiplied(x: torch.Tensor, qtype, max_integer_rows: int) -> np.ndarray:
    """x as the kernel multiplies it: for Q4_0/Q4_1/Q8_0/Q4_K at up to max_integer_rows rows (the
    integer paths) rounded to 8 bits (_round_x), otherwise x itself."""
    xf = x.float().numpy()
    name = qtype if isinstance(qtype, str) else {v[0]: k for k, v in ops.QUANT_TYPES.items()}[qtype]
    return _round_x(xf) if name in INTEGER_TYPES and x.shape[0] <= max_integer_rows else xf.astype(np.float64)


def _check(out: torch.Tensor, x: torch.Tensor, w64: np.ndarray, rtol: float, qtype,
           max_integer_rows: int = _core.QUANT_INTEGER_GEMM_MAX_ROWS) -> None:
    ref = _as_multiplied(x, qtype, max_integer_rows) @ w64.T
    assert np.abs(ref).max() > 0  # never compare zeros
    err = np.abs(out.double().numpy() - ref).max() / np.abs(ref).max()
    assert err < rtol, err


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_every_type_every_isa_against_float64(isa, qtype):
    # K not a multiple of 256 where the format allows it (32-value blocks); N odd.
    k = 288 if ops.QUANT_TYPES[qtype][1] == 32 else 512
    n = 37
    qweight, w64 = _weights(qtype, n, k, seed=ALL_TYPES.index(qtype))
    deq = ops.dequantize_rows(qweight, qtype, k)
    np.testing.assert_allclose(deq.double().numpy(), w64, rtol=1e-6, atol=1e-6 * np.abs(w64).max())
    gen = torch.Generator().manual_seed(1)
    # 32-value types: integer decode path (m <= QUANT_INTEGER_PATH_ROWS), then the integer GEMM;
    # the other types, and the 32-value ones with the GEMM off: float dot path (m < 128),
    # outer-product path (257 = 42 * 6 + 5)
    rows = _core.QUANT_INTEGER_PATH_ROWS
    for m in (1, 2, 3, 4, 5, 17, rows, rows + 1, 64, 257):
        x = torch.randn(m, k, generator=gen)
        _check(ops.quant_matmul(x, qweight, qtype, n, k), x, w64, 2e-6, qtype)
        if m > rows:
            with float_path():
                _check(ops.quant_matmul(x, qweight, qtype, n, k), x, w64, 2e-6, qtype, max_integer_rows=rows)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_activations_and_strided_rows(qtype, dtype):
    n, k = 70, 512
    qweight, w64 = _weights(qtype, n, k, seed=7)
    gen = torch.Generator().manual_seed(2)
    for m in (2, 40):
        wide = torch.randn(m, k + 64, generator=gen).to(dtype)
        x = wide[:, 32:32 + k]  # strided rows, contiguous columns
        out = torch.empty(m, n + 5, dtype=dtype)[:, :n]
        assert ops.quant_matmul(x, qweight, qtype, n, k, out=out) is out
        _check(out.float(), x.float(), w64, 1e-2, qtype)  # output rounded to 16 bits


def test_shapes_of_the_default_model_and_many_threads():
    # Tasks of the float path (32 rows), the integer paths (32 rows or more), a ragged last task.
    qweight, w64 = _weights("Q4_1", 1536 + 24, 576, seed=3)
    x = torch.randn(130, 576, generator=torch.Generator().manual_seed(3))
    ops.set_num_threads(3)
    try:
        _check(ops.quant_matmul(x, qweight, "Q4_1", 1560, 576), x, w64, 2e-6, "Q4_1")  # GEMM
        _check(ops.quant_matmul(x[:5], qweight, 3, 1560, 576), x[:5], w64, 2e-6, 3)  # integer path
        _check(ops.quant_matmul(x[:1], qweight, 3, 1560, 576), x[:1], w64, 2e-6, 3)  # integer path
        rows = _core.QUANT_INTEGER_PATH_ROWS
        _check(ops.quant_matmul(x[:rows], qweight, 3, 1560, 576), x[:rows], w64, 2e-6, 3)  # integer path
        _check(ops.quant_matmul(x[:rows + 1], qweight, 3, 1560, 576), x[:rows + 1], w64, 2e-6, 3)  # GEMM
        with float_path():
            _check(ops.quant_matmul(x, qweight, 3, 1560, 576), x, w64, 2e-6, 3, max_integer_rows=rows)
    finally:
        ops.set_num_threads(None)


def _poisoned(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"))


@contextlib.contextmanager
def float_path():
    """Q4_0/Q4_1/Q8_0 beyond QUANT_INTEGER_PATH_ROWS rows on the float paths (the integer GEMM
    off, as for the K formats); afterwards the default again."""
    _core.set_quant_integer_gemm_rows(0)
    try:
        yield
    finally:
        _core.set_quant_integer_gemm_rows(_core.QUANT_INTEGER_GEMM_MAX_ROWS)


# The integer GEMM path (Q4_0/Q4_1/Q8_0/Q4_K beyond QUANT_INTEGER_PATH_ROWS rows): awkward n
# (one row, tasks of 32 rows with ragged ends) and k (one block, an odd block count, the
# model's; Q4_K: one to six super-blocks).
@pytest.mark.parametrize("qtype", INTEGER_TYPES)
@pytest.mark.parametrize("n,k", [(1, 32), (3, 96), (17, 576), (100, 1536), (257, 96)])
def test_integer_gemm_against_float64(qtype, n, k):
    k = _integer_k(qtype, k)
    qweight, w64 = _weights(qtype, n, k, seed=11 + n)
    gen = torch.Generator().manual_seed(n + k)
    for m in (17, 31, 64, 257):
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4  # row scales differ
        out = ops.quant_matmul(x, qweight, qtype, n, k, out=_poisoned(m, n))
        assert torch.isfinite(out).all()
        # (a) the dequantized weights times x rounded as the kernel rounds it: float32 roundings only
        ref = _round_x(x.numpy()) @ w64.T
        scale = np.abs(_round_x(x.numpy())) @ np.abs(w64).T  # bounds the summation's rounding error
        np.testing.assert_array_less(np.abs(out.double().numpy() - ref), 1e-5 * scale + 1e-30)
        # (b) x itself: off by at most x's rounding, sum_k |w_k| * d_k / 2 (d_k = max|x| / 127 of k's block)
        d = np.repeat(np.abs(x.numpy().reshape(m, -1, 32)).max(axis=-1) / 127, 32, axis=1).astype(np.float64)
        bound = (d / 2) @ np.abs(w64).T * 1.001 + 1e-5 * scale
        np.testing.assert_array_less(np.abs(out.double().numpy() - x.double().numpy() @ w64.T), bound)


@pytest.mark.parametrize("qtype", INTEGER_TYPES)
@pytest.mark.parametrize("n", [1, 6, 70, 1560])
def test_integer_gemm_rows_equal_single_rows_bitwise(qtype, n):
    # Every (weight row, x row) pair runs the same arithmetic in both integer paths, whatever m,
    # task split (the decode path's tasks read their quarters side by side: n = 6 leaves a
    # stream empty, 70 and 1560 make ragged last tasks) or thread count: a row of a batch equals
    # that row alone (the decode path), bit for bit, and 1 thread equals 2 and 3.
    k = _integer_k(qtype, 96 * 3)  # 9 blocks: an odd block count (Q4_K: 2 super-blocks)
    qweight, _ = _weights(qtype, n, k, seed=5)
    x = torch.randn(257, k, generator=torch.Generator().manual_seed(6))
    single = torch.cat([ops.quant_matmul(x[i:i + 1], qweight, qtype, n, k) for i in range(x.shape[0])])
    try:
        for threads in (1, 2, 3):
            ops.set_num_threads(threads)
            for m in (2, 5, 16, 17, 64, 257):
                out = ops.quant_matmul(x[:m], qweight, qtype, n, k, out=_poisoned(m, n))
                assert torch.equal(out, single[:m]), (threads, m)
    finally:
        ops.set_num_threads(None)
    # The float path it replaces differs (x is not rounded there): the comparison can fail.
    with float_path():
        assert not torch.equal(ops.quant_matmul(x[:64], qweight, qtype, n, k), single[:64])


def test_integer_gemm_prefill_chunk():
    # One prefill chunk of the engine (2048 rows) on the model's down projection shape.
    n, k, m = 576, 1536, 2048
    qweight, w64 = _weights("Q4_1", n, k, seed=9)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9))
    out = ops.quant_matmul(x, qweight, "Q4_1", n, k, out=_poisoned(m, n))
    _check(out, x, w64, 2e-6, "Q4_1", max_integer_rows=m)
    rows = [0, 1, 1000, m - 1]
    assert torch.equal(out[rows], torch.cat([ops.quant_matmul(x[i:i + 1], qweight, "Q4_1", n, k) for i in rows]))


# Q4_1 and Q8_0 rows as the worker repacks them for the CPU decode kernel (Q4_1x4, Q8_0x4, or
# with VNNI Q4_1x8, Q8_0x8): every path and instruction set gives the GGUF layout's results bitwise.
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("layout", ["x4", "x8"])
def test_repacked_layouts_equal_the_file_layout_bitwise(isa, qtype, layout):
    n, k = 72, 576
    packed_type = qtype + layout
    repack = ops.repack_x4 if layout == "x4" else ops.repack_x8
    qweight, _ = _weights(qtype, n, k, seed=12)
    packed = repack(qweight, qtype, n, k)
    assert packed.shape == qweight.shape and not torch.equal(packed, qweight)
    assert torch.equal(ops.dequantize_rows(packed, packed_type, k), ops.dequantize_rows(qweight, qtype, k))
    x = torch.randn(131, k, generator=torch.Generator().manual_seed(12))
    try:
        for threads in (1, 2, 3):  # the decode path's head and tail tasks fall differently
            ops.set_num_threads(threads)
            # The decode path, passes of 4 (x4) or up to 8 (x8) x rows; the GEMM (x8 with VNNI:
            # the decode kernel, chunks of 64 rows).
            for m in (1, 3, 5, 9, 16, 17, 70, 131):
                want = ops.quant_matmul(x[:m], qweight, qtype, n, k)
                assert torch.equal(ops.quant_matmul(x[:m], packed, packed_type, n, k, out=_poisoned(m, n)), want)
    finally:
        ops.set_num_threads(None)
    with float_path():
        assert torch.equal(ops.quant_matmul(x, packed, packed_type, n, k),
                           ops.quant_matmul(x, qweight, qtype, n, k))
    assert repack(qweight[:4 if layout == "x8" else 6], qtype, 4 if layout == "x8" else 6, k) is None  # partial group
    if layout == "x4":
        odd, _ = _weights(qtype, 4, 96, seed=12)
        assert ops.repack_x4(odd, qtype, 4, 96) is None  # an odd number of blocks per row


def test_x8_layout_takes_odd_blocks_and_every_q8_0_quant():
    qweight, _ = _weights("Q8_0", 16, 96, seed=15)
    qweight[5, 34 + 2 + 9] = 0x80  # a quant of -128, which x4 refuses
    packed = ops.repack_x8(qweight, "Q8_0", 16, 96)
    x = torch.randn(11, 96, generator=torch.Generator().manual_seed(15))
    assert torch.equal(ops.quant_matmul(x, packed, "Q8_0x8", 16, 96), ops.quant_matmul(x, qweight, "Q8_0", 16, 96))
    assert ops.repack_x8(_weights("Q4_0", 8, 64, seed=15)[0], "Q4_0", 8, 64) is None  # no x8 layout


def test_q8_0_rows_with_a_quant_of_minus_128_stay_as_in_the_file():
    # The Q8_0x4 kernel moves x's sign onto the weights, where -128 has no negation.
    qweight, _ = _weights("Q8_0", 8, 64, seed=14)
    qweight[5, 34 + 2 + 9] = 0x80  # row 5, block 1, quant 9
    assert ops.repack_x4(qweight, "Q8_0", 8, 64) is None
    assert ops.repack_x4(_weights("Q4_0", 8, 64, seed=14)[0], "Q4_0", 8, 64) is None  # no x4 layout


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("vocab", [12, 16])  # groups of four only; of eight too (x8 with VNNI)
def test_repacked_embedding_lookups_and_logits(qtype, vocab):
    from vpage.model_executor.layers.quant_linear import QuantizedEmbedding

    hidden = 64
    qweight, _ = _weights(qtype, vocab, hidden, seed=13)
    table = QuantizedEmbedding(vocab, hidden, torch.float32, qtype)
    table.qweight.data.copy_(qweight)
    ids = torch.tensor([0, 5, 11, 5, 7])
    hidden_rows = torch.randn(3, hidden, generator=torch.Generator().manual_seed(13))
    before = table(ids), table.logits(hidden_rows)
    table.repack()
    layout = "x8" if vocab % 8 == 0 and _core.quant_reads_x8() else "x4"
    assert table.qtype == qtype + layout and not torch.equal(table.qweight.data, qweight)
    assert torch.equal(table(ids), before[0]) and torch.equal(table.logits(hidden_rows), before[1])


def test_empty_batch_and_argument_checks():
    qweight, _ = _weights("Q8_0", 4, 64, seed=4)
    assert ops.quant_matmul(torch.empty(0, 64), qweight, "Q8_0", 4, 64).shape == (0, 4)
    assert ops.quant_row_bytes("Q4_K", 512) == 288 and ops.quant_row_bytes(14, 256) == 210
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="unsupported quantization"):
        ops.quant_matmul(x, qweight, "Q5_0", 4, 64)
    with pytest.raises(ValueError, match="multiple of 256"):
        ops.quant_row_bytes("Q4_K", 576)
    with pytest.raises(ValueError, match="bytes"):
        ops.quant_matmul(x, qweight, "Q8_0", 5, 64)
    with pytest.raises(TypeError, match="uint8"):
        ops.quant_matmul(x, qweight.float(), "Q8_0", 4, 64)
    with pytest.raises(ValueError, match="x must be"):
        ops.quant_matmul(torch.randn(2, 32), qweight, "Q8_0", 4, 64)
    with pytest.raises(ValueError, match="out must be"):
        ops.quant_matmul(x, qweight, "Q8_0", 4, 64, out=torch.empty(2, 3))
    with pytest.raises(ValueError, match="bad sizes"):  # the kernel's own check
        _core._cpu_quant_matmul(0, 0, qweight.data_ptr(), 1, 4, 48, 48, 4, 8, 0, 1)


def test_quantization_option_is_checked():
    from vpage.engine.arg_utils import EngineArgs
    from vpage.model_executor import load_model

    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="int4")
    with pytest.raises(ValueError, match="quantization"):
        load_model(quantization="gptq")
