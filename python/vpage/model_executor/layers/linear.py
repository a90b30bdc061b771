"""Inference-only linear and embedding layers with uninitialised (to be loaded) weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def empty_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """A frozen parameter of ``shape`` on the current default device, not initialised."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ weight.T + bias``; weight ``[out_features, in_features]``.

    Fused projections (QKV, gate/up) are one ``Linear`` whose rows are the parts stacked
    in order; the loader fills each part's row range.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_parameter(out_features, in_features, dtype=dtype)
        self.bias = empty_parameter(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, in_features]`` -> ``[num_tokens, out_features]``, same dtype."""
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embedding table ``[vocab_size, hidden_size]``."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_parameter(vocab_size, hidden_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids ``[num_tokens]`` int64 -> ``[num_tokens, hidden_size]``."""
        return F.embedding(input_ids, self.weight)
