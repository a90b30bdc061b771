"""vpage.ops.rms_norm / fused_add_rms_norm / silu_and_mul on the CPU against float64
references and against torch's unfused operations."""

import pytest
import torch
import torch.nn.functional as F

from vpage import ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative tolerance against float64: a few roundings of the dtype.
REL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Absolute tolerance of tiny products: float16's subnormal spacing (6e-8) limits it.
TINY = {torch.float32: 1e-30, torch.float16: 6e-8, torch.bfloat16: 1e-30}


def rand(*shape, dtype, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return ((torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale).to(dtype)


def assert_close(out, ref, dtype, atol=0.0):
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs()
    bound = REL[dtype] * ref.abs() + atol
    assert (err <= bound).all(), f"max error {err.max().item()}"


def rms_reference(src, weight, eps):
    s = src.double()
    return s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(0, 64), (1, 1), (3, 7), (37, 576), (9, 1000)])
def test_rms_norm_matches_float64(dtype, tokens, hidden):
    x = rand(tokens, hidden, dtype=dtype, scale=3.0)
    weight = rand(hidden, dtype=dtype, seed=1) + 1.5
    out = torch.full_like(x, float("nan"))
    ops.rms_norm(out, x, weight, 1e-5)
    assert_close(out, rms_reference(x, weight, 1e-5), dtype, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_both_in_place(dtype):
    x = rand(37, 576, dtype=dtype, scale=2.0)
    residual = rand(37, 576, dtype=dtype, scale=5.0, seed=2)
    weight = rand(576, dtype=dtype, seed=1) + 1.5
    expected_residual = residual + x  # torch's add: one rounding to the dtype
    ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_residual)
    assert_close(x, rms_reference(expected_residual, weight, 1e-6), dtype, atol=1e-6)
    # and within one rounding of torch's unfused float32-statistics computation
    unfused = F.rms_norm(expected_residual.float(), (576,), eps=1e-6).to(dtype) * weight
    assert_close(x, unfused.double(), dtype, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, d", [(0, 8), (1, 1), (5, 13), (37, 1536)])
def test_silu_and_mul_matches_float64(dtype, tokens, d):
    x = rand(tokens, 2 * d, dtype=dtype, scale=12.0)
    if tokens:
        x[0, 0] = 100.0  # exp(-x) underflows
        x[0, d - 1] = -100.0  # exp(-x) would overflow
    out = torch.full((tokens, d), float("nan"), dtype=dtype)
    ops.silu_and_mul(out, x)
    gate, up = x[:, :d].double(), x[:, d:].double()
    assert_close(out, gate * torch.sigmoid(gate) * up, dtype, atol=TINY[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_within_an_ulp_of_torch(dtype):
    x = rand(64, 2 * 300, dtype=dtype, scale=8.0)
    out = torch.empty(64, 300, dtype=dtype)
    ops.silu_and_mul(out, x)
    ref = F.silu(x[:, :300]) * x[:, 300:]
    assert_close(out, ref.double(), dtype, atol=TINY[dtype])


def test_results_do_not_depend_on_the_thread_count():
    x = rand(61, 576, dtype=torch.float32, scale=3.0)
    residual = rand(61, 576, dtype=torch.float32, seed=3)
    weight = rand(576, dtype=torch.float32, seed=1)
    results = []
    for threads in (1, 3):
        ops.set_num_threads(threads)
        try:
            xi, ri, out = x.clone(), residual.clone(), torch.empty(61, 288)
            ops.fused_add_rms_norm(xi, ri, weight, 1e-5)
            ops.silu_and_mul(out, xi)
            results.append((xi, ri, out))
        finally:
            ops.set_num_threads(None)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_bad_arguments_are_rejected_before_any_work():
    x = torch.ones(4, 8)
    with pytest.raises(ValueError, match="weight has 4 elements"):
        ops.rms_norm(torch.empty_like(x), x, torch.ones(4), 1e-5)
    with pytest.raises(TypeError, match="dtype"):
        ops.fused_add_rms_norm(x, torch.ones(4, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        ops.rms_norm(torch.empty(8, 4).t(), x, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="epsilon"):
        ops.rms_norm(torch.empty_like(x), x, torch.ones(8), -1.0)
    with pytest.raises(ValueError, match="must be \\[num_tokens, 2 \\* 3\\]"):
        ops.silu_and_mul(torch.empty(4, 3), x)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        ops.silu_and_mul(torch.empty(4, 4, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32))
