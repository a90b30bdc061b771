"""Rotary position embedding in Hugging Face's rotate-half convention."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from vpage import ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama-3.1 frequency-dependent scaling of ``inv_freq`` (as Hugging Face defines it)."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(head_size: int, theta: float, scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_size // 2]`` float32 for rope types default/linear/llama3.

    Raises ValueError for other rope types (yarn, dynamic, longrope, ...).
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table of every position and rotates query and key heads in place."""

    def __init__(self, head_size: int, theta: float, scaling: Mapping[str, Any] | None, max_position: int):
        super().__init__()
        inv_freq = rope_inv_freq(head_size, theta, scaling)
        # The same float32 products as transformers' per-call computation, so cos/sin match it.
        freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)
        self.head_size = head_size

    def rotate_(self, qk: torch.Tensor, batch: Any, num_heads: int) -> None:
        """Rotate, in place, the first ``num_heads`` heads of each row of ``qk``
        ``[num_tokens, width]`` (query then key heads of a fused QKV output) for the tokens of
        ``batch`` (a ``ForwardBatch``: their positions, and for rope kinds that depend on a
        sequence's length, its context length)."""
        ops.rotary_embedding(qk, batch.positions, self.cos_sin, num_heads, self.head_size)
