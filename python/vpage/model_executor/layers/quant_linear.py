"""Linear and embedding layers whose weight stays in a GGUF block format (CPU, one rank).

The weight is a uint8 parameter ``qweight`` ``[rows, quant_row_bytes(qtype, cols)]``: each
row's raw GGUF blocks, exactly as in the file (rows of fused projections are the parts' rows
stacked, as :class:`~vpage.model_executor.layers.parallel_linear.OutputRows` lays them out).
It loads only from :class:`QuantizedTensor` rows of the same type. Matmuls dequantize inside
the kernel (:func:`vpage.ops.quant_matmul`); embedding lookups dequantize only the looked-up
rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vpage import ops
from vpage.model_executor.layers.parallel_linear import OutputRows, RowPart
from vpage.model_executor.layers.weight_utils import (QuantizedTensor, ShardId, empty_parameter, float_tensor,
                                                      set_weight_loader)


class QuantizedWeight(nn.Module):
    """``qweight``: ``rows`` rows of ``cols`` values in block format ``qtype`` (a name of
    :data:`vpage.ops.QUANT_TYPES`), laid out as ``layout`` says (default: one checkpoint
    tensor); ``dtype`` is the activation dtype."""

    def __init__(self, rows: int, cols: int, qtype: str, dtype: torch.dtype, layout: OutputRows | None = None):
        super().__init__()
        self.rows, self.cols, self.qtype, self.dtype = rows, cols, qtype, dtype
        self.type_id = ops.QUANT_TYPES[qtype][0]
        self.layout = layout or OutputRows([RowPart(None, rows, 0, rows)])
        self.qweight = empty_parameter(rows, ops.quant_row_bytes(qtype, cols), dtype=torch.uint8)
        set_weight_loader(self.qweight, self._load_qweight, self.layout.shard_ids)

    def _load_qweight(self, param: nn.Parameter, loaded: Any, shard_id: ShardId) -> None:
        if (not isinstance(loaded, QuantizedTensor) or loaded.type_id != self.type_id
                or loaded.cols != self.cols):
            got = (f"ggml type {loaded.type_id}, {loaded.cols} columns" if isinstance(loaded, QuantizedTensor)
                   else f"{loaded.dtype}")
            raise ValueError(f"({got}) does not match the quantized parameter ({self.qtype}, {self.cols} columns)")
        self.layout.load(param.data, loaded.data, shard_id)

    def linear(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[num_tokens, cols]`` -> ``x @ W.T`` ``[num_tokens, rows]``, x's dtype (into ``out``
        when given: contiguous, that shape and dtype)."""
        return ops.quant_matmul(x, self.qweight, self.qtype, self.rows, self.cols, out)

    def extra_repr(self) -> str:
        return f"rows={self.rows}, cols={self.cols}, qtype={self.qtype}"


class QuantizedLinear(QuantizedWeight):
    """``y = x @ W.T + bias`` with W ``[out_features, in_features]`` kept quantized; the bias
    (if any) is a float parameter of the activation dtype, laid out like W's rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, qtype: str,
                 layout: OutputRows | None = None):
        super().__init__(out_features, in_features, qtype, dtype, layout)
        self.bias = empty_parameter(out_features, dtype=dtype) if bias else None
        set_weight_loader(self.bias, self._load_bias, self.layout.shard_ids)

    def _load_bias(self, param: nn.Parameter, loaded: Any, shard_id: ShardId) -> None:
        self.layout.load(param.data, float_tensor(loaded), shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, in_features]`` -> ``[num_tokens, out_features]``, same dtype."""
        y = self.linear(x)
        return y if self.bias is None else y.add_(self.bias)


class QuantizedEmbedding(QuantizedWeight):
    """Token embedding table ``[vocab_size, hidden_size]`` kept quantized (also usable as a
    tied output projection through :meth:`linear`)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, qtype: str):
        super().__init__(vocab_size, hidden_size, qtype, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids ``[num_tokens]`` int64 -> ``[num_tokens, hidden_size]`` (activation dtype)."""
        rows = self.qweight.index_select(0, input_ids)
        return ops.dequantize_rows(rows, self.qtype, self.cols).to(self.dtype)
