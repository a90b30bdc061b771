"""Vocabulary-parallel embedding and output projection.

Each rank holds ``ceil(vocab / size)`` consecutive rows of the table (the last rank's tail
padded with zeros). The embedding looks up the ids of its range, zeroes the others and
sums over the ranks; the output projection computes its rows' logits, gathered on rank 0
and cut back to the vocabulary. With one rank they are plain embeddings. ``VocabShard`` is
the split itself, shared with the quantized table (``quant_linear.QuantizedEmbedding``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from vpage.distributed.parallel_state import all_reduce, gather_to_driver, tp_rank, tp_size
from vpage.model_executor.layers.linear import Embedding
from vpage.model_executor.layers.weight_utils import ShardId, copy_checked, float_tensor, set_weight_loader


class VocabShard:
    """This rank's ``rows`` consecutive rows of a ``[vocab_size, ...]`` table, from ``start``:
    all of them with one rank, ``ceil(vocab_size / size)`` under tensor parallelism."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.size = tp_size()
        self.rows = math.ceil(vocab_size / self.size)
        self.start = tp_rank() * self.rows

    def load(self, dest: torch.Tensor, loaded: torch.Tensor) -> None:
        """This rank's rows of the whole table ``loaded`` ``[vocab_size, ...]`` into ``dest``
        ``[rows, ...]``; rows past the vocabulary are zeroed (float rows, or raw GGUF block
        rows: zero bytes are zero values in every block format)."""
        if loaded.shape[0] != self.vocab_size or loaded.shape[1:] != dest.shape[1:]:
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {(self.vocab_size, *dest.shape[1:])}")
        mine = loaded[self.start:self.start + self.rows]
        dest[mine.shape[0]:].zero_()
        copy_checked(dest[:mine.shape[0]], mine)

    def embed(self, input_ids: torch.Tensor, lookup: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """input_ids ``[n]`` -> ``[n, hidden]``: ``lookup`` (local row ids -> their rows) of the
        ids in this rank's range, zeros for the others, summed over the ranks."""
        if self.size == 1:
            return lookup(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        h = lookup(local.masked_fill(outside, 0))
        h.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(h)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """This rank's logits ``[n, rows]`` -> ``[n, vocab_size]`` on rank 0, None elsewhere."""
        if self.size == 1:
            return local
        full = gather_to_driver(local)
        return None if full is None else full[:, :self.vocab_size]


class VocabParallelEmbedding(Embedding):
    """Rows ``[start, start + rows)`` of a ``[vocab_size, hidden_size]`` table; also the
    output projection (``logits``) when the embeddings are tied."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        shard = VocabShard(vocab_size)
        super().__init__(shard.rows, hidden_size, dtype)
        self.shard = shard
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: ShardId) -> None:
        """This rank's rows of the whole table (past the vocabulary: zeros)."""
        if shard_id is not None:
            raise ValueError(f"is part {shard_id!r} of a parameter that has no parts")
        self.shard.load(param.data, float_tensor(loaded))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.shard.embed(input_ids, self.weight_rows)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """hidden ``[n, hidden_size]`` -> float32 logits ``[n, vocab_size]`` on rank 0, None elsewhere;
        written into ``out`` (float32 ``[n, vocab_size]``) on one rank with packed or float32 weights."""
        one_rank = self.shard.size == 1
        if self.packed is not None:  # float32 logits straight from the kernel, whatever the dtypes
            out = out if one_rank else None
            return self.shard.gather_logits(self.matmul(hidden, out=out, out_dtype=torch.float32))
        if out is not None and one_rank and self.weight.dtype == hidden.dtype == torch.float32:
            return torch.matmul(hidden, self.weight.t(), out=out)  # what F.linear computes, in place
        return self.shard.gather_logits(self.matmul(hidden).float())


class ParallelLMHead(VocabParallelEmbedding):
    """An untied output projection, split by vocabulary rows like the embedding."""
