"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from vpage import ops
from vpage.model_executor.layers.weight_utils import empty_parameter


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 like Hugging Face."""

    cpu_decoder_role = "rms_norm"  # the C++ layer loop's RMSNorm kernel (models/cpu_decoder.py)

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_parameter(hidden_size, dtype=dtype)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` (or ``x + residual``); both ``[num_tokens, hidden_size]``.

        Returns ``(normed, new_residual)``. With a residual, the sum is accumulated into
        ``residual`` in place, ``x`` is overwritten with the normed rows, and the two are
        returned; without one, ``x`` itself is the new residual. ``x`` is contiguous.
        """
        if residual is None:
            out = torch.empty_like(x)
            ops.rms_norm(out, x, self.weight, self.eps)
            return out, x
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual
