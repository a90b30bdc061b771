"""Prompt logprobs (``SamplingParams.prompt_logprobs``), the engine core's side: the extra rows
of a step that need logits, and the model runner's scores of them handed to each request (the
front end adds the tokens' text).

The logits of the row at position p score prompt token p + 1, so a request needs the rows of
positions 0 .. len(prompt) - 2 (its last prompt row is the row it samples from, which the
step computes anyway). Prefill chunks contribute their rows in order; a request's list holds
one entry per prompt token scored so far (the first is never scored), so when a preemption by
recompute runs rows again, the positions already scored are skipped. A step with no such
request pending costs one check of an empty dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from vpage import _core
from vpage.engine.core_requests import CoreRequest
from vpage.worker.prompt_logprobs import PromptLogprobRows, PromptScores


@dataclass
class PromptRows:
    """The prompt rows of one step: what the model runner scores (``scored``: the rows in the
    order their scores come back, their target tokens, their top counts), and per request the
    positions ``[begin, end)`` whose rows it takes, in that order."""

    scored: PromptLogprobRows
    segments: list[tuple[CoreRequest, int, int]]


class PromptLogprobs:
    """The requests whose prompt rows are not all scored yet, by sequence id."""

    def __init__(self) -> None:
        self.pending: dict[int, CoreRequest] = {}

    def add(self, state: CoreRequest) -> None:
        if state.params.prompt_logprobs is not None and len(state.prompt_token_ids) > 1:
            for seq_id in state.seqs:
                self.pending[seq_id] = state

    def forget(self, state: CoreRequest) -> None:
        """Drops a request that ended (finished, aborted or ignored) while pending."""
        if self.pending:
            for seq_id in state.seqs:
                self.pending.pop(seq_id, None)

    def rows(self, plan: _core.SchedulePlan) -> Optional[PromptRows]:
        """The rows of ``plan`` whose logits pending requests still need; None when there are none."""
        if not self.pending or not plan.num_seqs:
            return None
        seq_ids = plan.seq_ids
        hits = np.flatnonzero(np.isin(seq_ids, np.fromiter(self.pending, dtype=np.int64, count=len(self.pending))))
        if not len(hits):
            return None
        starts, positions = plan.query_start_loc, plan.positions
        rows, targets, num_top, segments = [], [], [], []
        claimed: dict[str, int] = {}  # request id -> next position to score after this step's earlier rows
        for r in hits.tolist():
            state = self.pending[int(seq_ids[r])]
            begin, end = int(starts[r]), int(starts[r + 1])
            first = int(positions[begin])
            scored = claimed.get(state.request_id, state.num_prompt_scored - 1)
            if first > scored:
                raise RuntimeError(f"request {state.request_id}: prompt rows from position {first} but only "
                                   f"{scored} scored (a prefix-cache hit on a prompt_logprobs request)")
            lo, hi = scored, min(first + end - begin, len(state.prompt_token_ids) - 1)
            if hi <= lo:
                continue
            rows.append(np.arange(begin + lo - first, begin + hi - first, dtype=np.int64))
            targets.append(np.asarray(state.prompt_token_ids[lo + 1:hi + 1], dtype=np.int64))
            num_top.append(np.full(hi - lo, state.params.prompt_logprobs, dtype=np.int64))
            segments.append((state, lo, hi))
            claimed[state.request_id] = hi
        if not segments:
            return None
        return PromptRows(PromptLogprobRows(np.concatenate(rows), np.concatenate(targets), np.concatenate(num_top)),
                          segments)

    def record(self, scores: PromptScores, step: PromptRows) -> None:
        """Hands the scores of ``step``'s prompt tokens to their requests, in position order."""
        targets = step.scored.targets.tolist()
        row = 0
        for state, begin, end in step.segments:
            for i in range(row, row + end - begin):
                state.new_prompt_scores.append((targets[i], scores.logprobs[i], scores.ranks[i], scores.top_ids[i],
                                                scores.top_logprobs[i]))
            state.num_prompt_scored += end - begin
            row += end - begin
            if state.num_prompt_scored == len(state.prompt_token_ids):
                self.forget(state)
