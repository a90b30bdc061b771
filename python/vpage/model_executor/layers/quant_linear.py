"""Linear and embedding layers whose weight stays in a GGUF block format (CPU).

The weight is a uint8 parameter ``qweight`` ``[rows, quant_row_bytes(qtype, cols)]``: each
row's raw GGUF blocks, exactly as in the file (rows of fused projections are the parts' rows
stacked, as :class:`~vpage.model_executor.layers.parallel_linear.OutputRows` lays them out).
It loads only from :class:`QuantizedTensor` rows of the same type. Matmuls dequantize inside
the kernel (:func:`vpage.ops.quant_matmul`); embedding lookups dequantize only the looked-up
rows (of a repacked table, their groups). Once loaded, Q4_1 and Q8_0 rows are regrouped for
the CPU decode kernel (:func:`repack_quantized_weights`, called by the worker: the
``"Q4_1x4"`` / ``"Q8_0x4"`` layouts, or with VNNI ``"Q4_1x8"`` / ``"Q8_0x8"``, the same bytes
and results).

Under tensor parallelism a block is never cut: a column-parallel layer keeps whole rows (its
``OutputRows``), the embedding whole vocabulary rows (``VocabShard``), and a row-parallel
layer (:class:`QuantizedRowParallelLinear`) the bytes of its blocks in every row, which needs
``in_features / size`` to be whole blocks (:func:`block_splits`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vpage import ops
from vpage.distributed.parallel_state import all_reduce, tp_rank, tp_size
from vpage.model_executor.layers.parallel_linear import OutputRows, RowPart
from vpage.model_executor.layers.vocab_parallel import VocabShard
from vpage.model_executor.layers.weight_utils import (QuantizedTensor, ShardId, empty_parameter, float_tensor,
                                                      set_weight_loader)


def block_splits(cols: int, qtype: str) -> list[int]:
    """The tensor-parallel sizes that split rows of ``cols`` values of ``qtype`` into whole
    blocks per rank (the divisors of the blocks per row)."""
    blocks = cols // ops.QUANT_TYPES[qtype][1]
    return [size for size in range(1, blocks + 1) if blocks % size == 0]


class QuantizedWeight(nn.Module):
    """``qweight``: ``rows`` rows of ``cols`` values in block format ``qtype`` (a name of
    :data:`vpage.ops.QUANT_TYPES`), laid out as ``layout`` says (default: one checkpoint
    tensor); ``dtype`` is the activation dtype."""

    lora = None  # a projection serving LoRA adapters: its vpage.lora.layers.LoraHook

    def __init__(self, rows: int, cols: int, qtype: str, dtype: torch.dtype, layout: OutputRows | None = None):
        super().__init__()
        self.rows, self.cols, self.qtype, self.dtype = rows, cols, qtype, dtype
        self.checkpoint_cols = cols  # a row-parallel shard holds a slice of the checkpoint's columns
        self.type_id = ops.QUANT_TYPES[qtype][0]
        self.layout = layout or OutputRows([RowPart(None, rows, 0, rows)])
        self.qweight = empty_parameter(rows, ops.quant_row_bytes(qtype, cols), dtype=torch.uint8)
        set_weight_loader(self.qweight, self._load_qweight, self.layout.shard_ids)

    def _load_qweight(self, param: nn.Parameter, loaded: Any, shard_id: ShardId) -> None:
        if (not isinstance(loaded, QuantizedTensor) or loaded.type_id != self.type_id
                or loaded.cols != self.checkpoint_cols):
            got = (f"ggml type {loaded.type_id}, {loaded.cols} columns" if isinstance(loaded, QuantizedTensor)
                   else f"{loaded.dtype}")
            raise ValueError(f"({got}) does not match the quantized parameter ({self.qtype}, "
                             f"{self.checkpoint_cols} columns)")
        self._load_rows(param.data, loaded.data, shard_id)

    def _load_rows(self, dest: torch.Tensor, raw: torch.Tensor, shard_id: ShardId) -> None:
        """This rank's rows of checkpoint block rows ``raw`` (part ``shard_id``) into ``dest``."""
        self.layout.load(dest, raw, shard_id)

    def repack(self) -> None:
        """After every part is loaded: Q4_1 / Q8_0 rows -> the layout this CPU's decode kernel
        reads fastest (:func:`vpage.ops.repack_for_cpu`: x8 with VNNI, else x4) where they allow
        it, in place (the parameter keeps its storage)."""
        if self.qweight.device.type != "cpu":
            return
        repacked = ops.repack_for_cpu(self.qweight.data, self.qtype, self.rows, self.cols)
        if repacked is not None:
            self.qweight.data.copy_(repacked[0])
            self.qtype = repacked[1]
            self.type_id = ops.REPACKED_TYPES[self.qtype][0]

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
        """x ``[num_tokens, in_features]`` -> ``[num_tokens, out_features]``, same dtype (plus the
        rows' LoRA adapters when the layer serves some)."""
        y = self.linear(x)
        if self.lora is not None:
            self.lora.add_(x, y)
        return y if self.bias is None else y.add_(self.bias)


class QuantizedRowParallelLinear(QuantizedLinear):
    """``y = all_reduce(x_local @ W_local.T) + bias``, as ``RowParallelLinear`` sums it (the
    bias added once, after), with W kept quantized: this rank holds input columns ``[rank *
    in / size, (rank + 1) * in / size)``, i.e. of every row the bytes of those blocks.
    ValueError unless ``size`` is one of ``block_splits(in_features, qtype)``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, qtype: str):
        size, rank = tp_size(), tp_rank()
        if size not in block_splits(in_features, qtype):
            raise ValueError(f"tensor_parallel_size {size} would cut the {qtype} blocks of {in_features} input "
                             f"columns; sizes that keep them whole: {block_splits(in_features, qtype)}")
        super().__init__(in_features // size, out_features, bias, dtype, qtype)
        self.checkpoint_cols = in_features
        self.rank = rank

    def _load_rows(self, dest: torch.Tensor, raw: torch.Tensor, shard_id: ShardId) -> None:
        row_bytes = dest.shape[1]  # whole blocks, so rank r's columns start at byte r * row_bytes
        super()._load_rows(dest, raw.narrow(1, self.rank * row_bytes, row_bytes), shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, in_features / size]`` (this rank's columns) -> ``[num_tokens, out_features]``."""
        y = self.linear(x)
        if self.lora is not None:  # this rank's partial sum of the adapters too
            self.lora.add_(x, y)
        y = all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)


class QuantizedEmbedding(QuantizedWeight):
    """Token embedding table ``[vocab_size, hidden_size]`` kept quantized, split by vocabulary
    rows like ``VocabParallelEmbedding`` (whole rows: no block is cut); also the output
    projection (``logits``), tied or not."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, qtype: str):
        shard = VocabShard(vocab_size)
        super().__init__(shard.rows, hidden_size, qtype, dtype)
        self.shard = shard

    def _load_rows(self, dest: torch.Tensor, raw: torch.Tensor, shard_id: ShardId) -> None:
        if shard_id is not None:
            raise ValueError(f"is part {shard_id!r} of a parameter that has no parts")
        self.shard.load(dest, raw)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids ``[num_tokens]`` int64 -> ``[num_tokens, hidden_size]`` (activation dtype)."""
        return self.shard.embed(input_ids, self._lookup)

    def _lookup(self, rows: torch.Tensor) -> torch.Tensor:
        if self.qtype not in ops.REPACKED_TYPES:
            return ops.dequantize_rows(self.qweight.index_select(0, rows), self.qtype, self.cols).to(self.dtype)
        # A repacked row is not whole on its own: each row's group, then the row.
        size, row_bytes = ops.REPACK_GROUP_ROWS[self.qtype], self.qweight.shape[1]
        groups = self.qweight.view(-1, size * row_bytes).index_select(0, rows // size).view(-1, row_bytes)
        dense = ops.dequantize_rows(groups, self.qtype, self.cols).view(-1, size, self.cols)
        return dense[torch.arange(rows.numel()), rows % size].to(self.dtype)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """hidden ``[n, hidden_size]`` -> float32 logits ``[n, vocab_size]`` on rank 0, None
        elsewhere; written into ``out`` (``[n, vocab_size]`` of hidden's dtype) on one rank."""
        if self.shard.size == 1:
            return self.linear(hidden, out).float()
        return self.shard.gather_logits(self.linear(hidden).float())


def repack_quantized_weights(model: nn.Module) -> None:
    """Repacks the loaded quantized weights of ``model`` for the CPU decode kernel
    (:meth:`QuantizedWeight.repack`)."""
    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            module.repack()
