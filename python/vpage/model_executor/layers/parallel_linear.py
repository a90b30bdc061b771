"""Megatron-style tensor-parallel linear layers, the head split they serve, and how their
weights load.

A column-parallel layer holds, of each checkpoint part (q, k, v; gate, up; or one whole
matrix), this rank's slice of the output rows (its attention heads, its share of the
intermediate size), and needs no communication; a row-parallel layer holds the matching slice
of the input columns and sums the partial products over the ranks with one all-reduce. Both
take checkpoint tensors whole and keep their own slice; a fused layer also takes one
pre-fused tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``: the parts' whole rows stacked).
With one rank they are plain ``Linear``s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from vpage.distributed.parallel_state import all_reduce, tp_rank, tp_size
from vpage.model_executor.layers.linear import Linear
from vpage.model_executor.layers.weight_utils import ShardId, copy_checked, float_tensor, set_weight_loader


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


@dataclass(frozen=True)
class RowPart:
    """One checkpoint part of a layer's output rows: the checkpoint tensor has ``total`` rows,
    this rank keeps ``rows`` of them from ``start``."""

    shard_id: ShardId
    total: int
    start: int
    rows: int


class OutputRows:
    """The output rows of a column-parallel layer: each part's slice of this rank, stacked in
    part order. ``load`` works on float rows and on raw GGUF block rows alike."""

    def __init__(self, parts: Sequence[RowPart]):
        self.parts = tuple(parts)
        self.size = sum(part.rows for part in self.parts)

    @classmethod
    def split(cls, sizes: Sequence[int], shard_ids: Sequence[ShardId]) -> "OutputRows":
        """Parts of ``sizes`` rows, each split evenly over the ranks."""
        size, rank = tp_size(), tp_rank()
        for total in sizes:
            if total % size:
                raise ValueError(f"tensor_parallel_size {size} does not divide the output size {total}")
        return cls([RowPart(i, total, rank * (total // size), total // size) for i, total in zip(shard_ids, sizes)])

    @classmethod
    def qkv(cls, head_size: int, num_heads: int, num_kv_heads: int) -> "OutputRows":
        """Query, key and value parts ("q", "k", "v") of ``num_heads`` query and ``num_kv_heads``
        KV heads: this rank's query heads and its KV heads (a share, or one replicated head)."""
        size, rank = tp_size(), tp_rank()
        check_head_split(num_heads, num_kv_heads, size)
        q_rows = num_heads // size * head_size
        kv_rows = local_kv_heads(num_kv_heads, size) * head_size
        kv_start = kv_head_start(num_kv_heads, rank, size) * head_size
        kv_total = num_kv_heads * head_size
        return cls([RowPart("q", num_heads * head_size, rank * q_rows, q_rows),
                    RowPart("k", kv_total, kv_start, kv_rows), RowPart("v", kv_total, kv_start, kv_rows)])

    @property
    def shard_ids(self) -> tuple[ShardId, ...]:
        return tuple(part.shard_id for part in self.parts)

    @property
    def sizes(self) -> list[int]:
        """Local rows of each part."""
        return [part.rows for part in self.parts]

    def load(self, dest: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId) -> None:
        """Copy this rank's rows of checkpoint tensor ``loaded`` (part ``shard_id``; None: a
        whole parameter, pre-fused when there are several parts) into ``dest``."""
        if shard_id is None and len(self.parts) > 1:
            totals = [part.total for part in self.parts]
            if loaded.shape[0] != sum(totals):
                raise ValueError(f"has shape {tuple(loaded.shape)}, expected ({sum(totals)}, ...) (fused "
                                 f"parts of {totals} rows)")
            for part, piece in zip(self.parts, loaded.split(totals)):
                self._load_part(dest, part, piece)
            return
        part = next((part for part in self.parts if part.shard_id == shard_id), None)
        if part is None:
            raise ValueError(f"is part {shard_id!r} of a parameter made of parts {list(self.shard_ids)}")
        self._load_part(dest, part, loaded)

    def _load_part(self, dest: torch.Tensor, part: RowPart, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != part.total:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {(part.total, *dest.shape[1:])}")
        offset = sum(p.rows for p in self.parts[:self.parts.index(part)])
        copy_checked(dest.narrow(0, offset, part.rows), loaded.narrow(0, part.start, part.rows))


class ColumnParallelLinear(Linear):
    """A float ``Linear`` whose output rows are ``rows``' (this rank's slice of each part)."""

    def __init__(self, in_features: int, rows: OutputRows, bias: bool, dtype: torch.dtype):
        super().__init__(in_features, rows.size, bias, dtype)
        self.rows = rows
        set_weight_loader(self.weight, self.weight_loader, rows.shard_ids)
        set_weight_loader(self.bias, self.weight_loader, rows.shard_ids)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: ShardId) -> None:
        self.rows.load(param.data, float_tensor(loaded), shard_id)


class RowParallelLinear(Linear):
    """``y = all_reduce(x_local @ W_local.T) + bias``: this rank holds the input columns
    ``[rank * in / size, (rank + 1) * in / size)``; the bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        self.size = tp_size()
        self.rank = tp_rank()
        if in_features % self.size:
            raise ValueError(f"tensor_parallel_size {self.size} does not divide the input size {in_features}")
        self.local_in = in_features // self.size
        super().__init__(self.local_in, out_features, bias, dtype)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: ShardId) -> None:
        """The whole weight's columns of this rank (the bias loads whole)."""
        if shard_id is not None:
            raise ValueError(f"is part {shard_id!r} of a parameter that has no parts")
        loaded = float_tensor(loaded)
        if loaded.dim() != 2 or loaded.shape[1] != self.local_in * self.size:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected "
                             f"{(param.shape[0], self.local_in * self.size)}")
        copy_checked(param.data, loaded.narrow(1, self.rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return super().forward(x)
        y = self.matmul(x, with_bias=False)
        if self.lora is not None:  # this rank's partial sum of the adapters too
            self.lora.add_(x, y)
        y = all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)
