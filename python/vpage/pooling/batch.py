"""One step's sequences packed end to end: ``[num_tokens]`` ids, no padding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class PackedBatch:
    """Sequence i holds rows ``[starts[i], starts[i] + lens[i])`` of the flat tensors."""

    input_ids: torch.Tensor  # [num_tokens] int64
    token_type_ids: torch.Tensor  # [num_tokens] int64
    starts: list[int]
    lens: list[int]

    @classmethod
    def pack(cls, token_ids: Sequence[Sequence[int]], token_type_ids: Sequence[Optional[Sequence[int]]],
             device: torch.device) -> "PackedBatch":
        """Packs sequences (non-empty) and their token types (None: all 0)."""
        lens = [len(ids) for ids in token_ids]
        starts = [0] * len(lens)
        for i in range(1, len(lens)):
            starts[i] = starts[i - 1] + lens[i - 1]
        flat_ids = [t for ids in token_ids for t in ids]
        types = torch.zeros(len(flat_ids), dtype=torch.int64)
        for start, n, given in zip(starts, lens, token_type_ids):
            if given is not None:
                types[start:start + n] = torch.tensor(given, dtype=torch.int64)
        return cls(torch.tensor(flat_ids, dtype=torch.int64, device=device), types.to(device), starts, lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def first_rows(self) -> list[int]:
        """The row of each sequence's first token (CLS, ``<s>``)."""
        return list(self.starts)

    def last_rows(self) -> list[int]:
        """The row of each sequence's last token."""
        return [s + n - 1 for s, n in zip(self.starts, self.lens)]

    def sequence_index(self) -> torch.Tensor:
        """``[num_tokens]`` int64: which sequence each row belongs to."""
        counts = torch.tensor(self.lens, dtype=torch.int64, device=self.input_ids.device)
        return torch.repeat_interleave(torch.arange(len(self.lens), device=counts.device), counts)

    def positions(self) -> torch.Tensor:
        """``[num_tokens]`` int64: each token's position in its sequence, from 0."""
        starts = torch.tensor(self.starts, dtype=torch.int64, device=self.input_ids.device)
        return torch.arange(self.num_tokens, device=starts.device) - starts[self.sequence_index()]

    def padding_aware_positions(self, padding_idx: int) -> torch.Tensor:
        """RoBERTa's position ids (transformers' ``create_position_ids_from_input_ids``): tokens
        that are not ``padding_idx`` count from ``padding_idx + 1``; a padding token sits at
        ``padding_idx``."""
        real = (self.input_ids != padding_idx).to(torch.int64)
        counted = torch.cumsum(real, 0)
        before = torch.tensor(self.starts, dtype=torch.int64, device=counted.device)
        before = torch.where(before > 0, counted[(before - 1).clamp(min=0)], torch.zeros_like(before))
        return (counted - before[self.sequence_index()]) * real + padding_idx
