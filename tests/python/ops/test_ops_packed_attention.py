"""ops.packed_attention (the CPU kernel of encoders' bidirectional attention) and the pooling
layer's packed_attention over it, against a float64 reference: strided views of one fused QKV
output, poisoned outputs, lengths around the SIMD widths, pooler rows only, windows; bad
arguments raise before the kernel runs."""

from __future__ import annotations

import pytest
import torch

from vpage import _core, ops
from vpage.pooling.attention import _sdpa_per_sequence, packed_attention

pytestmark = pytest.mark.timeout(120)


def _reference(q, k, v, starts, lens, q_starts, q_lens, q_offsets, heads, hs, window):
    out = torch.empty(q.shape[0], heads * hs, dtype=torch.float64)
    for start, n, q_start, m, off in zip(starts, lens, q_starts, q_lens, q_offsets):
        qs = q[q_start:q_start + m].double().view(m, heads, hs).transpose(0, 1)
        ks = k[start:start + n].double().view(n, heads, hs).transpose(0, 1)
        vs = v[start:start + n].double().view(n, heads, hs).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * hs ** -0.5
        if window is not None:
            dist = (torch.arange(off, off + m)[:, None] - torch.arange(n)[None, :]).abs()
            scores = scores.masked_fill(dist > window, float("-inf"))
        out[q_start:q_start + m] = (scores.softmax(-1) @ vs).transpose(0, 1).reshape(m, heads * hs)
    return out


def _packed(lens, heads, hs, dtype, pooler_rows, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = heads * hs
    qkv = torch.randn(sum(lens), 3 * hidden, generator=g).to(dtype)
    q, k, v = qkv.split([hidden] * 3, dim=-1)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    if not pooler_rows:
        return q, k, v, starts, lens, starts, lens, [0] * len(lens)
    offsets = [int(torch.randint(0, n, (1,), generator=g)) for n in lens]
    index = torch.tensor([s + o for s, o in zip(starts, offsets)])
    return q[index], k, v, starts, lens, list(range(len(lens))), [1] * len(lens), offsets


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("pooler_rows", [False, True])
def test_matches_float64(dtype, tol, window, pooler_rows):
    heads, hs = 3, 32
    q, k, v, starts, lens, q_starts, q_lens, offsets = _packed([1, 15, 16, 17, 33, 130, 7], heads, hs, dtype,
                                                                pooler_rows, seed=7)
    out = torch.full((q.shape[0], heads * hs), float("nan"), dtype=dtype)
    got = packed_attention(q, k, v, starts, lens, q_starts, q_lens, heads, hs, out=out, window=window,
                           q_offsets=offsets)
    assert got.data_ptr() == out.data_ptr()
    want = _reference(q, k, v, starts, lens, q_starts, q_lens, offsets, heads, hs, window)
    assert (got.double() - want).abs().max().item() < tol
    # The SDPA path (other devices, other head sizes) agrees.
    sdpa = _sdpa_per_sequence(q, k, v, starts, lens, q_starts, q_lens, heads, hs, torch.empty_like(out), window,
                              offsets)
    assert (sdpa.double() - want).abs().max().item() < tol


def test_head_size_the_kernel_does_not_take_goes_to_sdpa():
    heads, hs = 2, 24
    q, k, v, starts, lens, q_starts, q_lens, offsets = _packed([9, 40], heads, hs, torch.float32, False, seed=3)
    got = packed_attention(q, k, v, starts, lens, q_starts, q_lens, heads, hs)
    want = _reference(q, k, v, starts, lens, q_starts, q_lens, offsets, heads, hs, None)
    assert (got.double() - want).abs().max().item() < 2e-5


def test_bad_arguments_raise():
    heads, hs = 2, 32
    rows = torch.randn(10, heads, hs)
    info = torch.tensor([[0], [10], [0], [10], [0]], dtype=torch.int32)
    ops.packed_attention(rows, rows, rows, info, 0.1)
    with pytest.raises(TypeError, match="key must have dtype"):
        ops.packed_attention(rows, rows.bfloat16(), rows, info, 0.1)
    with pytest.raises(ValueError, match=r"seq_info must have shape \[5, num_seqs\]"):
        ops.packed_attention(rows, rows, rows, info[:4], 0.1)
    with pytest.raises(ValueError, match="window"):
        ops.packed_attention(rows, rows, rows, info, 0.1, window=-2)
    with pytest.raises(ValueError, match="share"):
        ops.packed_attention(rows, rows[:, :1], rows[:, :1], info, 0.1)
    with pytest.raises(_core.CheckError, match="positions"):  # the kernel's own check: queries past the sequence
        ops.packed_attention(rows, rows, rows, torch.tensor([[0], [10], [0], [10], [1]], dtype=torch.int32), 0.1)
    with pytest.raises(_core.CheckError, match="key rows"):
        ops.packed_attention(rows, rows, rows, torch.tensor([[5], [10], [0], [1], [0]], dtype=torch.int32), 0.1)
