"""Rotary position embedding in Hugging Face's rotate-half convention."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn


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
    """Computes cos/sin per token and rotates query and key heads."""

    def __init__(self, head_size: int, theta: float, scaling: Mapping[str, Any] | None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_size, theta, scaling), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[num_tokens]`` int64 -> cos, sin ``[num_tokens, 1, head_size // 2]``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[num_tokens, num_heads, head_size]``; returns a new contiguous tensor.

        Equivalent to HF's ``x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)``.
        """
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
