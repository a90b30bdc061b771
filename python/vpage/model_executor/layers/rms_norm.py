"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vpage.model_executor.layers.linear import empty_parameter


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 like Hugging Face."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_parameter(hidden_size, dtype=dtype)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` (or ``x + residual``); both ``[num_tokens, hidden_size]``.

        Returns ``(normed, new_residual)``. With a residual, the sum is accumulated into
        ``residual`` in place and that tensor is returned as the new residual; without
        one, ``x`` itself is the new residual.
        """
        if residual is None:
            residual = x
        else:
            residual.add_(x)
        normed = F.rms_norm(residual.float(), self.weight.shape, eps=self.eps)
        return normed.to(residual.dtype) * self.weight, residual
