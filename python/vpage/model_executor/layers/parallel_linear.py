"""Megatron-style tensor-parallel linear layers and the head split they serve.

A column-parallel layer holds a slice of the output rows (each rank its attention heads or
its slice of the intermediate size) and needs no communication; a row-parallel layer holds
the matching slice of the input columns and sums the partial products over the ranks with
one all-reduce. Both take checkpoint tensors whole and keep their own slice
(``shard_checkpoint``). With one rank they are plain ``Linear``s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vpage.distributed.parallel_state import all_reduce, tp_rank, tp_size
from vpage.model_executor.layers.linear import Linear


def check_head_split(num_heads: int, num_kv_heads: int, size: int) -> None:
    """ValueError unless ``size`` ranks can split the heads: the query heads evenly, the KV
    heads evenly (``num_kv_heads % size == 0``) or replicated (``size % num_kv_heads == 0``)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    works = [s for s in range(1, num_heads + 1)
             if num_heads % s == 0 and (num_kv_heads % s == 0 or s % num_kv_heads == 0)]
    if size not in works:
        raise ValueError(f"tensor_parallel_size {size} cannot split {num_heads} attention heads and "
                         f"{num_kv_heads} KV heads (query heads must divide evenly; KV heads must divide "
                         f"evenly or be replicated): sizes that work are {works}")


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds: a share when they split, one (replicated) otherwise."""
    return num_kv_heads // size if num_kv_heads % size == 0 else 1


def kv_head_start(num_kv_heads: int, rank: int, size: int) -> int:
    """The first KV head of ``rank`` (replicated heads: ``size // num_kv_heads`` ranks share one)."""
    if num_kv_heads % size == 0:
        return rank * (num_kv_heads // size)
    return rank // (size // num_kv_heads)


class ColumnParallelLinear(Linear):
    """A ``Linear`` holding, of each checkpoint part (q, k, v; gate, up; or one whole
    matrix), the rows ``parts[i] = (start, rows)`` of this rank, stacked in part order."""

    def __init__(self, in_features: int, parts: list[tuple[int, int]], bias: bool, dtype: torch.dtype):
        super().__init__(in_features, sum(rows for _, rows in parts), bias, dtype)
        self.parts = parts

    def shard_sizes(self) -> list[int]:
        """Local rows of each part."""
        return [rows for _, rows in self.parts]

    def shard_checkpoint(self, tensor: torch.Tensor, part: int, is_bias: bool) -> torch.Tensor:
        start, rows = self.parts[part]
        return tensor.narrow(0, start, rows)


class RowParallelLinear(Linear):
    """``y = all_reduce(x_local @ W_local.T) + bias``: this rank holds the input columns
    ``[rank * in / size, (rank + 1) * in / size)``; the bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        self.size = tp_size()
        self.rank = tp_rank()
        self.local_in = in_features // self.size
        super().__init__(self.local_in, out_features, bias, dtype)

    def shard_checkpoint(self, tensor: torch.Tensor, part: int, is_bias: bool) -> torch.Tensor:
        return tensor if is_bias else tensor.narrow(1, self.rank * self.local_in, self.local_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y.add_(self.bias)
