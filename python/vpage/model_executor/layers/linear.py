"""Inference-only linear and embedding layers with uninitialised (to be loaded) weights.

On the CPU a loaded float weight is packed once for vpage's own matmul kernel
(:func:`pack_dense_weights`, called by the worker after loading): ``weight`` becomes None and
``packed`` holds it in ``ops.pack_dense_weight``'s panels; the layers then multiply with
``ops.dense_matmul`` (float32 accumulation, 16-bit weights widened in registers) and look up
embedding rows in the packed table, so the weight is held once.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from vpage import ops
from vpage.model_executor.layers.fused_moe import ExpertStack
from vpage.model_executor.layers.weight_utils import empty_parameter


class DenseWeight(nn.Module):
    """A float weight ``[rows, cols]`` (``weight``), or once packed for the CPU kernels,
    ``packed`` (``weight`` None) and ``packed_bias``, a float32 copy of the bias for the kernel."""

    # A projection serving LoRA adapters: its vpage.lora.layers.LoraHook (None: no adapters).
    lora = None

    def __init__(self, rows: int, cols: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight_shape = (rows, cols)
        self.weight = empty_parameter(rows, cols, dtype=dtype)
        self.bias = empty_parameter(rows, dtype=dtype) if bias else None
        self.packed: Optional[torch.Tensor] = None
        self.packed_bias: Optional[torch.Tensor] = None

    def pack(self) -> None:
        """Packs the loaded weight for ``ops.dense_matmul`` and drops the unpacked one."""
        self.packed = ops.pack_dense_weight(self.weight.data)
        self.packed_bias = None if self.bias is None else self.bias.data.float()
        self.weight = None

    def matmul(self, x: torch.Tensor, with_bias: bool = True, out: Optional[torch.Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """x ``[n, cols]`` -> ``x @ weight.T`` (``+ bias`` when ``with_bias``) ``[n, rows]``, in
        ``out_dtype`` (default x's; float32 for logits) and, packed weights only, into ``out``
        when given."""
        if self.packed is not None:
            bias = self.packed_bias if with_bias else None
            return ops.dense_matmul(x, self.packed, self.weight_shape[0], bias, out, out_dtype)
        y = F.linear(x, self.weight, self.bias if with_bias else None)
        return y if out_dtype is None else y.to(out_dtype)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64) of the weight, ``[len(ids), cols]`` (embedding lookups)."""
        if self.packed is not None:
            return ops.dense_rows(self.packed, ids)
        return F.embedding(ids, self.weight)


class Linear(DenseWeight):
    """``y = x @ weight.T + bias``; weight ``[out_features, in_features]``, each parameter
    loaded whole (the tensor-parallel and fused layers are in ``parallel_linear``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__(out_features, in_features, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, in_features]`` -> ``[num_tokens, out_features]``, same dtype (plus the
        rows' LoRA adapters when the layer serves some)."""
        y = self.matmul(x)
        if self.lora is not None:
            self.lora.add_(x, y)
        return y


class Embedding(DenseWeight):
    """Token embedding table ``[vocab_size, hidden_size]``."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__(vocab_size, hidden_size, False, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids ``[num_tokens]`` int64 -> ``[num_tokens, hidden_size]``."""
        return self.weight_rows(input_ids)


def pack_dense_weights(model: nn.Module) -> None:
    """Packs every loaded float weight of ``model`` (on the CPU) for the CPU matmul kernels
    (expert stacks for ``ops.fused_moe`` included)."""
    for module in model.modules():
        if isinstance(module, DenseWeight) and module.packed is None and module.weight.device.type == "cpu":
            module.pack()
        elif isinstance(module, ExpertStack) and module.packed is None and module.qtype is None and (
                module.weight.device.type == "cpu"):
            module.pack()
