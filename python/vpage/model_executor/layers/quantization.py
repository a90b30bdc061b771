"""Which weights a model keeps in a GGUF block format, decided before it is built: the model
asks this config for each linear and embedding layer by its name (the module path, e.g.
``model.layers.0.self_attn.qkv_proj``) and gets a quantized or a float layer.

Under tensor parallelism a quantized layer keeps whole blocks: column-parallel layers and the
vocabulary-split tables always can; a row-parallel layer only when ``in_features / size`` is
whole blocks, and otherwise stays float (dequantized at load) and is listed in
``cut_blocks_message``."""

from __future__ import annotations

import re
from typing import Callable, Mapping, Optional

import torch
from torch import nn

from vpage import ops
from vpage.distributed.parallel_state import tp_size
from vpage.model_executor.layers.parallel_linear import ColumnParallelLinear, OutputRows, RowParallelLinear
from vpage.model_executor.layers.quant_linear import (QuantizedEmbedding, QuantizedLinear,
                                                      QuantizedRowParallelLinear, block_splits)
from vpage.model_executor.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from vpage.model_executor.layers.weight_utils import ShardId

_NAMES_BY_ID = {type_id: name for name, (type_id, _, _) in ops.QUANT_TYPES.items()}
_LAYER_PREFIX = re.compile(r"^.*\.layers\.\d+\.")


class QuantConfig:
    """Float weights everywhere: the base, and any load that dequantizes (CUDA,
    ``quantization="none"``, a safetensors folder)."""

    def __init__(self) -> None:
        # (layer kind, in_features, qtype) -> layers of that kind left float because
        # tensor_parallel_size would cut their blocks
        self.cut_blocks: dict[tuple[str, int, str], int] = {}

    def qtype(self, prefix: str, cols: int) -> Optional[str]:
        """The block format to keep layer ``prefix``'s weight in (rows of ``cols`` values),
        None to keep it float."""
        return None

    def column_linear(self, prefix: str, in_features: int, rows: OutputRows, bias: bool,
                      dtype: torch.dtype) -> nn.Module:
        qtype = self.qtype(prefix, in_features)
        if qtype is not None:
            return QuantizedLinear(in_features, rows.size, bias, dtype, qtype, rows)
        return ColumnParallelLinear(in_features, rows, bias, dtype)

    def row_linear(self, prefix: str, in_features: int, out_features: int, bias: bool,
                   dtype: torch.dtype) -> nn.Module:
        qtype = self.qtype(prefix, in_features)
        size = tp_size()
        if qtype is not None and size == 1:
            return QuantizedLinear(in_features, out_features, bias, dtype, qtype)
        if qtype is not None and size in block_splits(in_features, qtype):
            return QuantizedRowParallelLinear(in_features, out_features, bias, dtype, qtype)
        if qtype is not None and in_features % size == 0:  # else RowParallelLinear names the bad size
            key = (_LAYER_PREFIX.sub("", prefix), in_features, qtype)
            self.cut_blocks[key] = self.cut_blocks.get(key, 0) + 1
        return RowParallelLinear(in_features, out_features, bias, dtype)

    def expert_qtype(self, prefix: str, cols: int, split_cols: bool) -> Optional[str]:
        """The block format of expert stack ``prefix`` (rows of ``cols`` values; None: float).
        A stack whose columns tensor parallelism splits (the down experts) stays float unless
        each rank gets whole blocks, and is then listed in ``cut_blocks_message``."""
        qtype = self.qtype(prefix, cols)
        if qtype is None or not split_cols or tp_size() in block_splits(cols, qtype):
            return qtype
        key = (_LAYER_PREFIX.sub("", prefix), cols, qtype)
        self.cut_blocks[key] = self.cut_blocks.get(key, 0) + 1
        return None

    def embedding(self, prefix: str, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> nn.Module:
        qtype = self.qtype(prefix, hidden_size)
        if qtype is not None:
            return QuantizedEmbedding(vocab_size, hidden_size, dtype, qtype)
        return VocabParallelEmbedding(vocab_size, hidden_size, dtype)

    def lm_head(self, prefix: str, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> nn.Module:
        """An untied output projection (quantized: used through ``QuantizedEmbedding.logits``)."""
        qtype = self.qtype(prefix, hidden_size)
        if qtype is not None:
            return QuantizedEmbedding(vocab_size, hidden_size, dtype, qtype)
        return ParallelLMHead(vocab_size, hidden_size, dtype)

    def cut_blocks_message(self) -> Optional[str]:
        """One line naming the row-parallel layers left float because tensor_parallel_size
        would cut their blocks, with the sizes that would keep each quantized; None if none."""
        if not self.cut_blocks:
            return None
        kinds = "; ".join(
            f"{kind} ({count} layer{'s' if count > 1 else ''}: {cols} input columns in {qtype} blocks of "
            f"{ops.QUANT_TYPES[qtype][1]} values, {cols // tp_size()} per rank; sizes that keep its blocks "
            f"whole: {block_splits(cols, qtype)})"
            for (kind, cols, qtype), count in self.cut_blocks.items())
        return (f"vpage: tensor_parallel_size {tp_size()} would cut GGUF blocks of row-parallel layers, so these "
                f"stay float (dequantized at load), the other layers quantized: {kinds}")


class GgufQuantConfig(QuantConfig):
    """Keeps a layer's weight in a GGUF block format when every checkpoint tensor that fills
    it has one type of ``ops.QUANT_TYPES`` and its rows split into whole blocks (under tensor
    parallelism, also each rank's columns of a row-parallel layer); a fused projection whose
    parts differ in type stays float (dequantized at load)."""

    def __init__(self, weight_types: Mapping[str, set[int]]):
        super().__init__()
        self.weight_types = dict(weight_types)

    @classmethod
    def from_tensor_types(cls, tensor_types: Mapping[str, int],
                          param_for: Callable[[str], Optional[tuple[str, ShardId]]]) -> "GgufQuantConfig":
        """From checkpoint name -> ggml type id, and the model's map of a checkpoint name to
        (parameter name, shard) (None: a tensor the model skips)."""
        by_layer: dict[str, set[int]] = {}
        for name, type_id in tensor_types.items():
            target = param_for(name)
            if target is not None and target[0].endswith(".weight"):
                by_layer.setdefault(target[0].removesuffix(".weight"), set()).add(type_id)
        return cls(by_layer)

    def qtype(self, prefix: str, cols: int) -> Optional[str]:
        types = self.weight_types.get(prefix, set())
        qtype = _NAMES_BY_ID.get(next(iter(types))) if len(types) == 1 else None
        if qtype is None or cols % ops.QUANT_TYPES[qtype][1]:
            return None
        return qtype
