"""The CUDA layer ops (rms_norm with and without the residual add, rms_norm_heads, rotary,
silu_and_mul) through vpage.ops against torch's composite ops on the same GPU, the reference
each kernel reproduces. Outputs start poisoned with NaN; sizes are awkward on purpose.
Skipped without a GPU (tests marked ``cuda``)."""

from __future__ import annotations

import pytest
import torch

from device_marks import requires_cuda
from test_ops_cuda import DTYPES
from vpage import ops
from vpage.ops import layer

# Composite and kernel reduce mean(x^2) in different orders: the norms may differ by an ulp.
ULP = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def _rand(*shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (3 * torch.randn(*shape, generator=g, device="cuda")).to(dtype)


def _assert_ulp(actual, expected, dtype):
    assert not torch.isnan(actual).any()
    atol, rtol = ULP[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, cols", [(0, 64), (1, 1), (3, 7), (37, 576), (300, 960), (5, 4097)])
def test_rms_norm_matches_composite(dtype, rows, cols):
    x, w = _rand(rows, cols, dtype=dtype, seed=1), _rand(cols, dtype=dtype, seed=2)
    out = torch.full_like(x, float("nan"))
    ops.rms_norm(out, x, w, 1e-5)
    _assert_ulp(out, layer._torch_rms_norm(x, w, 1e-5), dtype)
    x_before = x.clone()
    ops.rms_norm(x, x, w, 1e-5)  # out may be input
    _assert_ulp(x, layer._torch_rms_norm(x_before, w, 1e-5), dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, cols", [(1, 576), (70, 2048), (4, 33)])
def test_fused_add_rms_norm_matches_composite(dtype, rows, cols):
    x, residual = (_rand(rows, cols, dtype=dtype, seed=s) for s in (3, 4))
    w = _rand(cols, dtype=dtype, seed=5)
    expected_residual = residual + x
    expected = layer._torch_rms_norm(expected_residual, w, 1e-6)
    ops.fused_add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, expected_residual)  # one rounded add, as torch does it
    _assert_ulp(x, expected, dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128])
def test_rms_norm_heads_matches_composite_and_leaves_other_columns(dtype, head_size):
    tokens, q_heads, kv_heads = 19, 6, 2
    qkv = _rand(tokens, (q_heads + 2 * kv_heads) * head_size, dtype=dtype, seed=6)
    w = _rand(head_size, dtype=dtype, seed=7)
    keys = qkv[:, q_heads * head_size:]  # strided rows: the key heads, then the values
    before = qkv.clone()
    ops.rms_norm_heads_(keys, w, 1e-6, kv_heads, head_size)
    heads = before[:, q_heads * head_size:(q_heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    _assert_ulp(qkv[:, q_heads * head_size:(q_heads + kv_heads) * head_size].view(tokens, kv_heads, head_size),
                layer._torch_rms_norm(heads, w, 1e-6), dtype)
    assert torch.equal(qkv[:, : q_heads * head_size], before[:, : q_heads * head_size])
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_size:], before[:, (q_heads + kv_heads) * head_size:])


def _composite_rotary(x, positions, cos_sin, num_heads, head_size, rotary_dim):
    """vpage.ops.rotary_embedding's torch path (the kernel's reference), on a copy."""
    half = rotary_dim // 2
    x = x.clone()
    heads = x[:, : num_heads * head_size].view(x.shape[0], num_heads, head_size)[..., :rotary_dim]
    table = cos_sin[positions][:, None, :]
    cos, sin = table[..., :half], table[..., half:]
    x1, x2 = heads[..., :half].float(), heads[..., half:].float()
    heads.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
    return x


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size, rotary_dim", [(64, 64), (128, 128), (96, 32)])
def test_rotary_matches_composite_exactly(dtype, head_size, rotary_dim):
    tokens, q_heads, kv_heads, max_pos = 23, 5, 1, 4096
    qkv = _rand(tokens, (q_heads + 2 * kv_heads) * head_size, dtype=dtype, seed=8)
    x = qkv[:, : (q_heads + kv_heads) * head_size]  # strided rows, values left alone
    positions = torch.randint(0, max_pos, (tokens,), device="cuda", dtype=torch.int64)
    angles = torch.rand(max_pos, rotary_dim // 2, device="cuda") * 6.3
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=1)
    expected = _composite_rotary(x, positions, cos_sin, q_heads + kv_heads, head_size, rotary_dim)
    values_before = qkv[:, (q_heads + kv_heads) * head_size:].clone()
    ops.rotary_embedding(x, positions, cos_sin, q_heads + kv_heads, head_size, rotary_dim)
    assert torch.equal(x, expected)  # the same float32 products and sums, rounded once
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_size:], values_before)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, d", [(0, 8), (1, 1), (5, 13), (37, 1536), (3, 8193)])
def test_silu_and_mul_matches_composite(dtype, tokens, d):
    x = _rand(tokens, 2 * d, dtype=dtype, seed=9)
    out = torch.full((tokens, d), float("nan"), dtype=dtype, device="cuda")
    ops.silu_and_mul(out, x)
    expected = torch.nn.functional.silu(x[:, :d]) * x[:, d:]
    _assert_ulp(out, expected, dtype)
