"""vpage.ops.gelu_tanh_and_mul on the CPU against a float64 reference and against torch's
``F.gelu(gate, approximate="tanh") * up``."""

import math

import pytest
import torch
import torch.nn.functional as F

from vpage import ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative tolerance of 16-bit results against float64: two roundings of the dtype.
REL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Absolute tolerance of tiny values: float16's subnormal spacing (6e-8) limits it.
TINY = {torch.float32: 1e-30, torch.float16: 6e-8, torch.bfloat16: 1e-30}
K = math.sqrt(2.0 / math.pi)


def rand(*shape, dtype, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return ((torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale).to(dtype)


def exponent(gate: torch.Tensor) -> torch.Tensor:
    """z = 2 sqrt(2/pi) (g + 0.044715 g^3): gelu_tanh(g) = g * sigmoid(z), in float64."""
    g = gate.double()
    return 2 * K * (g + 0.044715 * g**3)


def reference(x: torch.Tensor, d: int) -> torch.Tensor:
    """gelu_tanh(gate) * up in float64; 0.5 g (1 + tanh(z / 2)) written as g sigmoid(z), since
    even float64's `1 + tanh` cancels for gates below about -6."""
    gate, up = x[:, :d].double(), x[:, d:].double()
    return gate * torch.sigmoid(exponent(gate)) * up


def spacing(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dtype's spacing of floats at |v| (its ulp), at least the smallest subnormal."""
    info = torch.finfo(dtype)
    scale = torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(info.tiny))))
    return (scale * info.eps).clamp_min(info.tiny * info.eps)


def check_float64(out: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> None:
    d = out.shape[1]
    ref = reference(x, d)
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs()
    if dtype == torch.float32:
        # the kernel's documented bound: exp's argument z carries ~1.5e-7 |z| of float32 rounding
        rel = 2e-6 + 2e-7 * exponent(x[:, :d]).abs()
    else:
        rel = REL[dtype]
    bound = rel * ref.abs() + TINY[dtype] * (1 + x[:, d:].double().abs())  # gelu's subnormals, times up
    assert (err <= bound).all(), f"max error {err.max().item()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, d", [(0, 8), (1, 1), (3, 7), (5, 33), (2, 4096 + 3)])
def test_matches_float64(dtype, tokens, d):
    x = rand(tokens, 2 * d, dtype=dtype, scale=6.0, seed=d)
    if tokens:
        x[0, 0] = 100.0  # exp(-z) underflows: gelu(x) = x
        x[-1, d - 1] = -100.0  # exp(-z) is clamped: a result below 1e-36 instead of ~0
    out = torch.full((tokens, d), float("nan"), dtype=dtype)
    ops.gelu_tanh_and_mul(out, x)
    check_float64(out, x, dtype)
    if tokens > 1:
        assert out[0, 0].item() == (100.0 * x[0, d]).to(dtype).item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_close_to_torch(dtype):
    d = 333
    x = rand(64, 2 * d, dtype=dtype, scale=8.0, seed=5)
    out = torch.full((64, d), float("nan"), dtype=dtype)
    ops.gelu_tanh_and_mul(out, x)
    expected = (F.gelu(x[:, :d], approximate="tanh") * x[:, d:]).double()
    gate, up = x[:, :d].double(), x[:, d:].double()
    # torch's float32 `1 + tanh` cancels for negative gates: its absolute error is up to
    # ~6e-8 |gate| before the product.
    torch_error = 1.2e-7 * (gate * up).abs()
    if dtype == torch.float32:
        bound = (2e-6 + 2e-7 * exponent(gate).abs()) * expected.abs() + torch_error + TINY[dtype]
    else:
        # one ulp of gelu (float16's roundings differ now and then), then one of the product
        bound = 2 * spacing(expected, dtype) + torch_error
    err = (out.double() - expected).abs()
    assert (err <= bound).all(), f"max error {err.max().item()}"
    if dtype == torch.bfloat16:  # where torch does not cancel, bfloat16 rounds both alike
        accurate = gate > -2
        assert torch.equal(out.double()[accurate], expected[accurate])


def test_results_do_not_depend_on_the_thread_count():
    x = rand(61, 2 * 1000, dtype=torch.bfloat16, scale=5.0, seed=7)
    results = []
    for threads in (1, 2):
        ops.set_num_threads(threads)
        try:
            out = torch.full((61, 1000), float("nan"), dtype=torch.bfloat16)
            ops.gelu_tanh_and_mul(out, x)
            results.append(out)
        finally:
            ops.set_num_threads(None)
    assert torch.equal(results[0], results[1])
    check_float64(results[0], x, torch.bfloat16)


def test_trusted_result_equals_checked():
    x = rand(9, 2 * 48, dtype=torch.float32, scale=4.0, seed=2)
    checked, trusted = torch.empty(9, 48), torch.empty(9, 48)
    ops.gelu_tanh_and_mul(checked, x)
    with ops.trusted_arguments():
        ops.gelu_tanh_and_mul(trusted, x)
    assert torch.equal(checked, trusted)


def test_bad_arguments_are_rejected():
    x = torch.ones(4, 8)
    with pytest.raises(ValueError, match="must be \\[num_tokens, 2 \\* 3\\]"):
        ops.gelu_tanh_and_mul(torch.empty(4, 3), x)
    with pytest.raises(ValueError, match="must be \\[num_tokens, 2 \\* 0\\]"):
        ops.gelu_tanh_and_mul(torch.empty(4, 0), torch.ones(4, 0))
    with pytest.raises(TypeError, match="dtype"):
        ops.gelu_tanh_and_mul(torch.empty(4, 4, dtype=torch.bfloat16), x)
    with pytest.raises(ValueError, match="contiguous"):
        ops.gelu_tanh_and_mul(torch.empty(4, 4), torch.ones(8, 4).t())
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        ops.gelu_tanh_and_mul(torch.empty(4, 4, dtype=torch.float64), x.double())
