"""Vocabulary-parallel embedding and output projection.

Each rank holds ``ceil(vocab / size)`` consecutive rows of the table (the last rank's tail
padded with zeros). The embedding looks up the ids of its range, zeroes the others and
sums over the ranks; the output projection computes its rows' logits, gathered on rank 0
and cut back to the vocabulary. With one rank they are plain embeddings.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vpage.distributed.parallel_state import all_reduce, gather_to_driver, tp_rank, tp_size
from vpage.model_executor.layers.linear import Embedding
from vpage.model_executor.layers.weight_utils import ShardId, copy_checked, float_tensor, set_weight_loader


class VocabParallelEmbedding(Embedding):
    """Rows ``[start, start + rows)`` of a ``[vocab_size, hidden_size]`` table; also the
    output projection (``logits``) when the embeddings are tied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        self.vocab_size = vocab_size
        self.size = tp_size()
        self.rows = math.ceil(vocab_size / self.size)
        self.start = tp_rank() * self.rows
        super().__init__(self.rows if self.size > 1 else vocab_size, hidden_size, dtype)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: ShardId) -> None:
        """This rank's rows of the whole table (past the vocabulary: zeros)."""
        if shard_id is not None:
            raise ValueError(f"is part {shard_id!r} of a parameter that has no parts")
        loaded = float_tensor(loaded)
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {(self.vocab_size, param.shape[1])}")
        if self.size == 1:
            param.data.copy_(loaded)
            return
        mine = loaded[self.start:self.start + self.rows]
        param.data[mine.shape[0]:].zero_()
        copy_checked(param.data[:mine.shape[0]], mine)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return self.weight_rows(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        h = self.weight_rows(local.masked_fill(outside, 0))
        h.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(h)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """hidden ``[n, hidden_size]`` -> float32 logits ``[n, vocab_size]`` on rank 0, None elsewhere;
        written into ``out`` (float32 ``[n, vocab_size]``) on one rank with packed or float32 weights."""
        if self.packed is not None:  # float32 logits straight from the kernel, whatever the weights' dtype
            local = self.matmul(hidden.float(), out=out if self.size == 1 else None)
        elif out is not None and self.size == 1 and self.weight.dtype == hidden.dtype == torch.float32:
            return torch.matmul(hidden, self.weight.t(), out=out)  # what F.linear computes, in place
        else:
            local = self.matmul(hidden).float()
        if self.size == 1:
            return local
        full = gather_to_driver(local)
        return None if full is None else full[:, :self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied output projection, split by vocabulary rows like the embedding."""
