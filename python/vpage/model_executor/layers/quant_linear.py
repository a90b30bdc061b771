"""Linear and embedding layers whose weight stays in a GGUF block format (CPU).

The weight is a uint8 parameter ``qweight`` ``[rows, quant_row_bytes(qtype, cols)]``: each
row's raw GGUF blocks, exactly as in the file (rows of fused projections are the parts'
rows stacked, like :class:`~vpage.model_executor.layers.linear.Linear`). Matmuls dequantize
inside the kernel (:func:`vpage.ops.quant_matmul`); embedding lookups dequantize only the
looked-up rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vpage import ops
from vpage.model_executor.layers.linear import empty_parameter


@dataclass
class QuantizedTensor:
    """A checkpoint tensor kept in its GGUF block format: ``data`` uint8 ``[rows, row bytes]``
    holding ``rows`` rows of ``cols`` values of ggml type ``type_id``."""

    data: torch.Tensor
    type_id: int
    cols: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


class QuantizedWeight(nn.Module):
    """``qweight``: ``rows`` rows of ``cols`` values in block format ``qtype`` (a name of
    :data:`vpage.ops.QUANT_TYPES`); ``dtype`` is the activation dtype."""

    def __init__(self, rows: int, cols: int, qtype: str, dtype: torch.dtype):
        super().__init__()
        self.rows, self.cols, self.qtype, self.dtype = rows, cols, qtype, dtype
        self.type_id = ops.QUANT_TYPES[qtype][0]
        self.qweight = empty_parameter(rows, ops.quant_row_bytes(qtype, cols), dtype=torch.uint8)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, cols]`` -> ``x @ W.T`` ``[num_tokens, rows]``, x's dtype."""
        return ops.quant_matmul(x, self.qweight, self.qtype, self.rows, self.cols)

    def extra_repr(self) -> str:
        return f"rows={self.rows}, cols={self.cols}, qtype={self.qtype}"


class QuantizedLinear(QuantizedWeight):
    """``y = x @ W.T + bias`` with W ``[out_features, in_features]`` kept quantized; the bias
    (if any) is a float parameter of the activation dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, qtype: str):
        super().__init__(out_features, in_features, qtype, dtype)
        self.bias = empty_parameter(out_features, dtype=dtype) if bias else None

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
