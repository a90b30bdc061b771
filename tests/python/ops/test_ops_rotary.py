"""ops.rotary_embedding (fused CPU kernel) against the rotate-half formula in torch, over whole
heads and over their first rotary_dim elements (partial rotary)."""

import pytest
import torch

from vpage import ops


def table(max_position: int, head_size: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_size, 2).float() / head_size)
    freqs = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def reference(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, head_size: int,
              rotary_dim: int = 0):
    rotary_dim = rotary_dim or head_size
    half = rotary_dim // 2
    heads = x[:, : num_heads * head_size].float().view(x.shape[0], num_heads, head_size)
    cos, sin = cos_sin[positions][:, None, :half], cos_sin[positions][:, None, half:]
    x1, x2 = heads[..., :half], heads[..., half:rotary_dim]
    out = x.clone()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype)
    out[:, : num_heads * head_size].view(x.shape[0], num_heads, head_size)[..., :rotary_dim] = rotated
    return out


def float64_reference(x, positions, cos_sin, num_heads, head_size, rotary_dim):
    half = rotary_dim // 2
    heads = x[:, : num_heads * head_size].double().view(x.shape[0], num_heads, head_size)
    table = cos_sin.double()[positions][:, None, :]
    cos, sin = table[..., :half], table[..., half:]
    x1, x2 = heads[..., :half], heads[..., half:rotary_dim]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [64, 80, 128])
def test_matches_formula_on_strided_rows(dtype, head_size):
    torch.manual_seed(head_size)
    num_tokens, q_heads, kv_heads = 37, 9, 3
    width = (q_heads + 2 * kv_heads) * head_size
    base = torch.randn(num_tokens, width + 16, dtype=dtype)
    x = base[:, :width]  # rows strided: width + 16 apart
    positions = torch.randint(0, 500, (num_tokens,))
    cos_sin = table(512, head_size)
    expected = reference(x, positions, cos_sin, q_heads + kv_heads, head_size)
    ops.rotary_embedding(x, positions, cos_sin, q_heads + kv_heads, head_size)
    if dtype == torch.float32:
        assert torch.equal(x, expected)  # same float32 roundings as torch
    else:
        torch.testing.assert_close(x, expected, atol=0, rtol=0.01)
    assert torch.equal(x[:, (q_heads + kv_heads) * head_size:], expected[:, (q_heads + kv_heads) * head_size:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size, rotary_dim", [(64, 16), (64, 32), (96, 32), (96, 16), (80, 78)])
@pytest.mark.parametrize("threads", [1, 2])
def test_partial_rotary_rotates_only_the_first_dims(dtype, head_size, rotary_dim, threads):
    torch.manual_seed(rotary_dim * head_size)
    num_tokens, heads, offset, tail = 45, 7, 2 * head_size + 4, 9
    width = heads * head_size
    base = torch.randn(num_tokens, offset + width + tail, dtype=dtype)
    base[:, offset + width:] = float("nan")  # beyond the heads: never read into them, never written
    x = base[:, offset:]  # a strided view of a wider fused row, at an offset
    before = base.clone()
    positions = torch.randint(0, 300, (num_tokens,))
    cos_sin = table(300, rotary_dim)
    expected = reference(x[:, :width], positions, cos_sin, heads, head_size, rotary_dim)
    ref = float64_reference(x, positions, cos_sin, heads, head_size, rotary_dim)
    ops.set_num_threads(threads)
    try:
        ops.rotary_embedding(x, positions, cos_sin, heads, head_size, rotary_dim=rotary_dim)
    finally:
        ops.set_num_threads(None)
    got = x[:, :width]
    if dtype == torch.float32:
        assert torch.equal(got, expected)  # same float32 roundings as torch
    else:
        torch.testing.assert_close(got, expected, atol=0, rtol=0.01)
    rotated = got.view(num_tokens, heads, head_size)[..., :rotary_dim].double()
    step = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert ((rotated - ref).abs() <= step * (ref.abs() + 1)).all()
    # the unrotated part of each head, the columns before the heads and the NaN tail are untouched
    keep = before[:, offset:offset + width].view(num_tokens, heads, head_size)[..., rotary_dim:]
    assert torch.equal(got.view(num_tokens, heads, head_size)[..., rotary_dim:], keep)
    assert torch.equal(base[:, :offset], before[:, :offset])
    assert torch.isnan(base[:, offset + width:]).all()


def test_full_rotary_dim_equals_the_default():
    torch.manual_seed(1)
    x = torch.randn(9, 4 * 64)
    positions = torch.randint(0, 32, (9,))
    a, b = x.clone(), x.clone()
    ops.rotary_embedding(a, positions, table(32, 64), 4, 64)
    ops.rotary_embedding(b, positions, table(32, 64), 4, 64, rotary_dim=64)
    assert torch.equal(a, b) and not torch.equal(a, x)


def test_rejects_bad_input():
    cos_sin = table(16, 64)
    x = torch.randn(4, 3 * 64)
    with pytest.raises(ValueError, match="position"):
        ops.rotary_embedding(x, torch.tensor([0, 1, 2, 16]), cos_sin, 3, 64)
    with pytest.raises(ValueError, match="do not fit"):
        ops.rotary_embedding(x, torch.arange(4), cos_sin, 4, 64)
    with pytest.raises(ValueError, match="positions"):
        ops.rotary_embedding(x, torch.arange(3), cos_sin, 3, 64)
    with pytest.raises(ValueError, match="rotary_dim must be an even int"):
        ops.rotary_embedding(x, torch.arange(4), table(16, 15), 3, 64, rotary_dim=15)
    with pytest.raises(ValueError, match="rotary_dim must be an even int"):
        ops.rotary_embedding(x, torch.arange(4), table(16, 64)[:, :0], 3, 64, rotary_dim=0)
    with pytest.raises(ValueError, match="rotary_dim must be an even int"):
        ops.rotary_embedding(x, torch.arange(4), table(16, 66), 2, 64, rotary_dim=66)
    with pytest.raises(ValueError, match="rotary_dim 32"):  # the table is of whole heads
        ops.rotary_embedding(x, torch.arange(4), cos_sin, 3, 64, rotary_dim=32)
