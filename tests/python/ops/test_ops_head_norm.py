"""vpage.ops.rms_norm_heads_ (per-head q/k RMSNorm, in place) on the CPU: bit-equal to
ops.rms_norm on each head as a row, close to float64, and nothing outside the heads written."""

import pytest
import torch

from vpage import ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rand(*shape, dtype, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return ((torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale).to(dtype)


def fused_rows(tokens, num_heads, head_size, dtype, offset, tail, seed):
    """A wider fused row: `offset` columns before the heads, `tail` after (NaN, so a read or
    write past the heads shows); returns (base, x) with x = base[:, offset:], rows strided."""
    base = rand(tokens, offset + num_heads * head_size + tail, dtype=dtype, scale=3.0, seed=seed)
    base[:, offset + num_heads * head_size:] = float("nan")
    return base, base[:, offset:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
def test_equals_rms_norm_per_head_on_strided_rows(dtype, head_size):
    tokens, num_heads, offset, tail = 13, 5, 3 * head_size + 8, head_size + 5
    base, x = fused_rows(tokens, num_heads, head_size, dtype, offset, tail, seed=head_size)
    before = base.clone()
    weight = rand(head_size, dtype=dtype, seed=1) + 1.5
    heads = x[:, : num_heads * head_size].reshape(tokens * num_heads, head_size).clone()
    expected = torch.full_like(heads, float("nan"))
    ops.rms_norm(expected, heads, weight, 1e-6)
    ops.rms_norm_heads_(x, weight, 1e-6, num_heads, head_size)
    got = x[:, : num_heads * head_size].reshape(tokens * num_heads, head_size)
    assert torch.equal(got, expected)  # ops.rms_norm's roundings exactly
    h = heads.double()
    ref = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert ((got.double() - ref).abs() <= REL[dtype] * ref.abs() + 1e-6).all()
    # the columns before and after the heads (NaN after) are untouched
    assert torch.equal(base[:, :offset], before[:, :offset])
    assert torch.isnan(base[:, offset + num_heads * head_size:]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_key_heads_of_a_fused_qkv_row(dtype):
    """Qwen3's use: q heads, then the k heads through qkv[:, q_size:], v untouched."""
    tokens, q_heads, kv_heads, head_size = 7, 6, 2, 128
    q_size, kv_size = q_heads * head_size, kv_heads * head_size
    qkv = rand(tokens, q_size + 2 * kv_size, dtype=dtype, scale=2.0, seed=3)
    q_weight, k_weight = rand(head_size, dtype=dtype, seed=4) + 1, rand(head_size, dtype=dtype, seed=5) + 1
    original = qkv.clone()
    ops.rms_norm_heads_(qkv, q_weight, 1e-6, q_heads, head_size)
    ops.rms_norm_heads_(qkv[:, q_size:], k_weight, 1e-6, kv_heads, head_size)
    for start, heads, weight in ((0, q_heads, q_weight), (q_size, kv_heads, k_weight)):
        rows = original[:, start:start + heads * head_size].reshape(-1, head_size)
        expected = torch.empty_like(rows)
        ops.rms_norm(expected, rows, weight, 1e-6)
        assert torch.equal(qkv[:, start:start + heads * head_size].reshape(-1, head_size), expected)
    assert torch.equal(qkv[:, q_size + kv_size:], original[:, q_size + kv_size:])


def test_results_do_not_depend_on_the_thread_count():
    base, x = fused_rows(70, 9, 64, torch.bfloat16, offset=64, tail=3, seed=9)
    weight = rand(64, dtype=torch.bfloat16, seed=1) + 1
    results = []
    for threads in (1, 2):
        ops.set_num_threads(threads)
        try:
            b = base.clone()
            ops.rms_norm_heads_(b[:, 64:], weight, 1e-5, 9, 64)
            results.append(b)
        finally:
            ops.set_num_threads(None)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0, equal_nan=True)


def test_empty_and_single_rows():
    weight = torch.rand(16) + 0.5
    x = torch.randn(0, 48)
    ops.rms_norm_heads_(x, weight, 1e-6, 3, 16)
    one = torch.randn(1, 50)
    before = one.clone()
    ops.rms_norm_heads_(one, weight, 1e-6, 0, 16)  # no heads: nothing changes
    assert torch.equal(one, before)
    ops.rms_norm_heads_(one, weight, 1e-6, 3, 16)
    expected = torch.empty(3, 16)
    ops.rms_norm(expected, before[:, :48].reshape(3, 16), weight, 1e-6)
    assert torch.equal(one[:, :48].reshape(3, 16), expected) and torch.equal(one[:, 48:], before[:, 48:])


def test_trusted_result_equals_checked():
    x = rand(5, 4 * 32, dtype=torch.float32, scale=2.0, seed=6)
    weight = rand(32, dtype=torch.float32, seed=7)
    checked, trusted = x.clone(), x.clone()
    ops.rms_norm_heads_(checked, weight, 1e-6, 4, 32)
    with ops.trusted_arguments():
        ops.rms_norm_heads_(trusted, weight, 1e-6, 4, 32)
    assert torch.equal(checked, trusted)


def test_bad_arguments_are_rejected():
    x = torch.ones(4, 64)
    with pytest.raises(ValueError, match="do not fit rows of 64"):
        ops.rms_norm_heads_(x, torch.ones(16), 1e-6, 5, 16)
    with pytest.raises(ValueError, match="weight of 8 elements"):
        ops.rms_norm_heads_(x, torch.ones(8), 1e-6, 2, 16)
    with pytest.raises(TypeError, match="dtype"):
        ops.rms_norm_heads_(x, torch.ones(16, dtype=torch.bfloat16), 1e-6, 2, 16)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        ops.rms_norm_heads_(x.double(), torch.ones(16, dtype=torch.float64), 1e-6, 2, 16)
    with pytest.raises(ValueError, match="contiguous columns"):
        ops.rms_norm_heads_(torch.ones(64, 4).t(), torch.ones(16), 1e-6, 2, 16)
    with pytest.raises(ValueError, match="rows at least 32 apart"):
        ops.rms_norm_heads_(torch.ones(80).as_strided((4, 32), (16, 1)), torch.ones(16), 1e-6, 2, 16)
    with pytest.raises(ValueError, match="epsilon"):
        ops.rms_norm_heads_(x, torch.ones(16), -1.0, 2, 16)
    with pytest.raises(ValueError, match="must be ints"):
        ops.rms_norm_heads_(x, torch.ones(16), 1e-6, 2, 0)
