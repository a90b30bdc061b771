"""The step's token bitmask: one int32 row per sampled sequence, all ones where no grammar
applies, filled by the matchers elsewhere."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from vpage import ops
from vpage.structured_output.sequence import SequenceConstraint


class StepBitmask:
    """A reused host buffer of ``[rows, token_bitmask_words(vocab_size)]`` int32 (pinned when
    the sampler runs on CUDA, so the one copy per step is asynchronous), allocated for
    ``max_rows`` rows by the first step that needs it."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device | str = "cpu"):
        self.words = ops.token_bitmask_words(vocab_size)
        self.device = torch.device(device)
        self.max_rows = max(1, max_rows)
        self._host: Optional[torch.Tensor] = None

    def _alloc(self, rows: int) -> torch.Tensor:
        return torch.empty((rows, self.words), dtype=torch.int32, pin_memory=self.device.type == "cuda")

    def build(self, constraints: Sequence[Optional[SequenceConstraint]]) -> Optional[torch.Tensor]:
        """The bitmask of a step whose row i samples for ``constraints[i]`` (None: free), on
        the sampler's device; None when no row is constrained."""
        rows = [i for i, c in enumerate(constraints) if c is not None and c.active]
        if not rows:
            return None
        if self._host is None or len(constraints) > self._host.shape[0]:
            self._host = self._alloc(max(self.max_rows, len(constraints)))
        mask = self._host[: len(constraints)]
        mask.fill_(-1)
        for i in rows:
            constraints[i].matcher.fill_bitmask(mask, i)
        return mask.to(self.device, non_blocking=True) if self.device.type != "cpu" else mask
