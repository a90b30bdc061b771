"""The encoder architectures the pooling runner serves, by Hugging Face name, and loading
their checkpoints (with or without the base model's prefix, ``bert.`` / ``roberta.`` /
``model.``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn

from vpage.model_executor.layers.weight_utils import ShardId, shard_ids_of, weight_loader_of
from vpage.pooling.batch import PackedBatch
from vpage.pooling.encoder import Encoder
from vpage.pooling.heads import BertClassifierHead, ModernBertClassifierHead, RobertaClassifierHead
from vpage.pooling.modernbert import ModernBertEncoder


@dataclass(frozen=True)
class EncoderArch:
    """prefix: the base model's name in a task model's checkpoint; padding_positions: positions
    count from ``pad_token_id + 1`` (RoBERTa, XLM-R); head: the classifier, None for an
    embedding model."""

    prefix: str
    padding_positions: bool
    head: Optional[type[nn.Module]] = None
    encoder: type[nn.Module] = Encoder  # built as encoder(hf_config, dtype, padding_positions)


ENCODER_ARCHITECTURES: dict[str, EncoderArch] = {
    "BertModel": EncoderArch("bert", False),
    "BertForSequenceClassification": EncoderArch("bert", False, BertClassifierHead),
    "RobertaModel": EncoderArch("roberta", True),
    "RobertaForSequenceClassification": EncoderArch("roberta", True, RobertaClassifierHead),
    "XLMRobertaModel": EncoderArch("roberta", True),
    "XLMRobertaForSequenceClassification": EncoderArch("roberta", True, RobertaClassifierHead),
    "ModernBertModel": EncoderArch("model", False, None, ModernBertEncoder),
    "ModernBertForSequenceClassification": EncoderArch("model", False, ModernBertClassifierHead, ModernBertEncoder),
}
# A config without ``architectures``: the embedding model of its type.
_BY_MODEL_TYPE = {"bert": "BertModel", "roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel",
                 "modernbert": "ModernBertModel"}
# Checkpoint tensors no pooling model reads: pretraining heads, language-model heads.
_UNUSED_PREFIXES = ("cls.", "lm_head.", "pooler.")


def encoder_architecture(hf_config: Any) -> Optional[str]:
    """The encoder architecture of a transformers config (its ``architectures``, or the
    embedding model of its ``model_type``); None when it is not one of ENCODER_ARCHITECTURES."""
    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        return archs[0] if archs[0] in ENCODER_ARCHITECTURES else None
    return _BY_MODEL_TYPE.get(getattr(hf_config, "model_type", ""))


class EncoderModel(nn.Module):
    """An encoder, with a classification head for the ``*ForSequenceClassification`` ones."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, arch: EncoderArch):
        super().__init__()
        self.arch = arch
        self.encoder = arch.encoder(hf_config, dtype, arch.padding_positions)
        self.head = None if arch.head is None else arch.head(hf_config, dtype)
        self.num_labels = int(hf_config.num_labels) if self.head is not None else None
        self.position_offset = self.encoder.position_offset

    def forward(self, batch: PackedBatch, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Last hidden states ``[num_tokens, hidden]``, or only ``rows``' (one per sequence)."""
        return self.encoder(batch, rows)

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """Logits ``[num_seqs, num_labels]`` float32 from the first tokens' hidden states (the
        mean of each sequence's for a head whose ``pooling`` is "MEAN")."""
        return self.head(first).float()

    def param_for(self, name: str) -> Optional[tuple[str, ShardId]]:
        """(parameter, shard) for a checkpoint name; None for one this model does not use."""
        if self.head is not None:
            target = self.head.param_for(name)
            if target is not None:
                return f"head.{target}", None
        name = name.removeprefix(self.arch.prefix + ".")
        if name.startswith(_UNUSED_PREFIXES):
            return None
        target = self.encoder.param_for(name)
        return None if target is None else (f"encoder.{target[0]}", target[1])

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Loads checkpoint tensors (transformers' names) through each parameter's loader.
        ValueError on a shape mismatch or a parameter left unloaded."""
        params = dict(self.named_parameters())
        loaded: dict[str, set] = {name: set() for name in params}
        for name, tensor in weights:
            target = self.param_for(name)
            if target is None:
                continue
            param_name, shard = target
            if param_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            param = params[param_name]
            try:
                weight_loader_of(param)(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r} {e}") from e
            loaded[param_name].add(shard)
        missing = sorted({name for name, param in params.items() if None not in loaded[name]
                          for shard in shard_ids_of(param) if shard not in loaded[name]})
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. for {missing[:4]}")
