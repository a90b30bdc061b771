"""ops.rotary_embedding (fused CPU kernel) against the rotate-half formula in torch."""

import pytest
import torch

from vpage import ops


def table(max_position: int, head_size: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_size, 2).float() / head_size)
    freqs = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def reference(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, head_size: int):
    half = head_size // 2
    heads = x[:, : num_heads * head_size].float().view(x.shape[0], num_heads, head_size)
    cos, sin = cos_sin[positions][:, None, :half], cos_sin[positions][:, None, half:]
    x1, x2 = heads[..., :half], heads[..., half:]
    out = x.clone()
    out[:, : num_heads * head_size] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).reshape(
        x.shape[0], -1).to(x.dtype)
    return out


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


def test_rejects_bad_input():
    cos_sin = table(16, 64)
    x = torch.randn(4, 3 * 64)
    with pytest.raises(ValueError, match="position"):
        ops.rotary_embedding(x, torch.tensor([0, 1, 2, 16]), cos_sin, 3, 64)
    with pytest.raises(ValueError, match="do not fit"):
        ops.rotary_embedding(x, torch.arange(4), cos_sin, 4, 64)
    with pytest.raises(ValueError, match="positions"):
        ops.rotary_embedding(x, torch.arange(3), cos_sin, 3, 64)
