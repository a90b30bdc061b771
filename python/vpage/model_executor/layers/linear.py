"""Inference-only linear and embedding layers with uninitialised (to be loaded) weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vpage.model_executor.layers.weight_utils import empty_parameter


class Linear(nn.Module):
    """``y = x @ weight.T + bias``; weight ``[out_features, in_features]``, each parameter
    loaded whole (the tensor-parallel and fused layers are in ``parallel_linear``)."""

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
