"""Counters of verified drafts (vLLM's ``spec_decode_*`` metrics), fed from each step's
``ModelRunnerOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Rows that carried drafts, draft tokens, accepted ones, and accepted ones by position."""

    num_drafts: int = 0  # rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def add(self, num_drafts: int, num_accepted: int) -> None:
        """One row that carried ``num_drafts`` drafts, ``num_accepted`` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafts:
            self.accepted_per_pos.extend([0] * (num_drafts - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def add_step(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        """A step's samples (those without drafts count nothing)."""
        for drafts, accepted in zip(num_drafts, num_accepted):
            if drafts:
                self.add(drafts, accepted)
