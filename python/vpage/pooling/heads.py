"""Sequence classification heads, as transformers has them, on the first token's hidden state
(ModernBERT's: or on the mean of every token's)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from vpage.model_executor.layers.linear import Linear
from vpage.pooling.encoder import activation
from vpage.pooling.modernbert import layer_norm


class BertClassifierHead(nn.Module):
    """BertForSequenceClassification: the pooler (dense + tanh on [CLS]), then ``classifier``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        self.pooler = Linear(hf_config.hidden_size, hf_config.hidden_size, True, dtype)
        self.classifier = Linear(hf_config.hidden_size, hf_config.num_labels, True, dtype)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        """first ``[num_seqs, hidden]`` -> logits ``[num_seqs, num_labels]``."""
        return self.classifier(torch.tanh(self.pooler(first)))

    @staticmethod
    def param_for(name: str) -> Optional[str]:
        """This head's parameter for checkpoint name ``name`` (None: not the head's)."""
        for prefix, module in (("bert.pooler.dense.", "pooler."), ("pooler.dense.", "pooler."),
                               ("classifier.", "classifier.")):
            if name.startswith(prefix):
                return module + name.removeprefix(prefix)
        return None


class RobertaClassifierHead(nn.Module):
    """(XLM-)RobertaForSequenceClassification: ``classifier.dense`` + tanh on ``<s>``, then
    ``classifier.out_proj``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        self.dense = Linear(hf_config.hidden_size, hf_config.hidden_size, True, dtype)
        self.out_proj = Linear(hf_config.hidden_size, hf_config.num_labels, True, dtype)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        """first ``[num_seqs, hidden]`` -> logits ``[num_seqs, num_labels]``."""
        return self.out_proj(torch.tanh(self.dense(first)))

    @staticmethod
    def param_for(name: str) -> Optional[str]:
        for prefix in ("classifier.dense.", "classifier.out_proj."):
            if name.startswith(prefix):
                return name.removeprefix("classifier.")
        return None


class ModernBertClassifierHead(nn.Module):
    """ModernBertForSequenceClassification: ``head`` (dense, activation, LayerNorm) on the first
    token (``classifier_pooling`` "cls") or on the mean of every token ("mean", ``pooling``
    "MEAN"), then ``classifier``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        mode = getattr(hf_config, "classifier_pooling", "cls")
        if mode not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling must be 'cls' or 'mean', got {mode!r}")
        self.pooling = mode.upper()  # the PoolerConfig pooling_type the head reads
        self.dense = Linear(hf_config.hidden_size, hf_config.hidden_size, bool(hf_config.classifier_bias), dtype)
        self.act = activation(getattr(hf_config, "classifier_activation", "gelu"))
        self.norm = layer_norm(hf_config, dtype)
        self.classifier = Linear(hf_config.hidden_size, hf_config.num_labels, True, dtype)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled ``[num_seqs, hidden]`` -> logits ``[num_seqs, num_labels]``."""
        return self.classifier(self.norm(self.act(self.dense(pooled))))

    @staticmethod
    def param_for(name: str) -> Optional[str]:
        for prefix, module in (("head.dense.", "dense."), ("head.norm.", "norm."), ("classifier.", "classifier.")):
            if name.startswith(prefix):
                return module + name.removeprefix(prefix)
        return None
