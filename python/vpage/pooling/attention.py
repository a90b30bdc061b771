"""Bidirectional attention over packed sequences: no padding, one call per sequence."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: Sequence[int],
                     lens: Sequence[int], q_starts: Sequence[int], q_lens: Sequence[int], num_heads: int,
                     head_size: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Non-causal attention of each sequence's queries over all of its keys.

    k, v ``[num_tokens, num_heads * head_size]`` (rows may be strided: views of a fused QKV
    output), sequence i at rows ``[starts[i], starts[i] + lens[i])``; q ``[num_queries,
    num_heads * head_size]``, sequence i's queries at rows ``[q_starts[i], q_starts[i] +
    q_lens[i])`` (all of its tokens, or only the rows a pooler reads). Returns ``[num_queries,
    num_heads * head_size]`` in q's dtype (into ``out`` when given); softmax scale ``head_size ** -0.5``. Each sequence
    is one ``scaled_dot_product_attention`` call on head-major copies of its rows (its CPU
    kernel is several times faster on contiguous heads than on the strided token-major views).
    """
    if out is None:
        out = q.new_empty(q.shape[0], num_heads * head_size)
    for start, n, q_start, m in zip(starts, lens, q_starts, q_lens):
        heads = [t.view(-1, num_heads, head_size).transpose(0, 1).contiguous().unsqueeze(0)
                 for t in (q[q_start:q_start + m], k[start:start + n], v[start:start + n])]
        o = F.scaled_dot_product_attention(*heads)
        out[q_start:q_start + m].view(m, num_heads, head_size).copy_(o[0].transpose(0, 1))
    return out
