"""Bidirectional attention over packed sequences: no padding; optionally within a sliding window
(ModernBERT's local layers). On the CPU one call of vpage's packed-attention kernel for the
whole batch; elsewhere (or head sizes the kernel does not take) one SDPA call per sequence."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from vpage import ops


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: Sequence[int],
                     lens: Sequence[int], q_starts: Sequence[int], q_lens: Sequence[int], num_heads: int,
                     head_size: int, out: Optional[torch.Tensor] = None, window: Optional[int] = None,
                     q_offsets: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Non-causal attention of each sequence's queries over all of its keys.

    k, v ``[num_tokens, num_heads * head_size]`` (rows may be strided: views of a fused QKV
    output), sequence i at rows ``[starts[i], starts[i] + lens[i])``; q ``[num_queries,
    num_heads * head_size]``, sequence i's queries at rows ``[q_starts[i], q_starts[i] +
    q_lens[i])`` (all of its tokens, or only the rows a pooler reads). Returns ``[num_queries,
    num_heads * head_size]`` in q's dtype (into ``out`` when given); softmax scale ``head_size ** -0.5``.

    ``window`` w: a query attends only to the keys at most w positions before or after it
    (``|query position - key position| <= w``); query j of sequence i sits at position
    ``q_offsets[i] + j`` of its sequence (``q_offsets`` default: all 0, every token a query).
    """
    if out is None:
        out = q.new_empty(q.shape[0], num_heads * head_size)
    if q_offsets is None:
        q_offsets = [0] * len(starts)
    if q.device.type == "cpu" and head_size % 16 == 0:
        seq_info = torch.tensor([list(starts), list(lens), list(q_starts), list(q_lens), list(q_offsets)],
                                dtype=torch.int32)
        rows = [t.view(t.shape[0], num_heads, head_size) for t in (q, k, v, out)]
        ops.packed_attention(*rows[:3], seq_info, head_size ** -0.5, out=rows[3], window=window)
        return out
    return _sdpa_per_sequence(q, k, v, starts, lens, q_starts, q_lens, num_heads, head_size, out, window, q_offsets)


def _sdpa_per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: Sequence[int],
                       lens: Sequence[int], q_starts: Sequence[int], q_lens: Sequence[int], num_heads: int,
                       head_size: int, out: torch.Tensor, window: Optional[int],
                       q_offsets: Sequence[int]) -> torch.Tensor:
    """One ``scaled_dot_product_attention`` call per sequence on head-major copies of its rows
    (torch's CPU kernel is several times faster on contiguous heads than on strided views)."""
    for start, n, q_start, m, q_offset in zip(starts, lens, q_starts, q_lens, q_offsets):
        lo, hi, mask = 0, n, None
        if window is not None and n > window + 1:  # a shorter sequence lies whole in every window
            lo, hi = max(0, q_offset - window), min(n, q_offset + m + window)  # the keys any query sees
            q_pos = torch.arange(q_offset, q_offset + m, device=q.device)
            k_pos = torch.arange(lo, hi, device=q.device)
            mask = (q_pos[:, None] - k_pos[None, :]).abs() <= window
        heads = [t.view(-1, num_heads, head_size).transpose(0, 1).contiguous().unsqueeze(0)
                 for t in (q[q_start:q_start + m], k[start + lo:start + hi], v[start + lo:start + hi])]
        o = F.scaled_dot_product_attention(*heads, attn_mask=mask)
        out[q_start:q_start + m].view(m, num_heads, head_size).copy_(o[0].transpose(0, 1))
    return out
