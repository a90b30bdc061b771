"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the extra rows of a step that need
logits, and their log-probabilities turned into each request's ``prompt_logprobs``.

The logits of the row at position p score prompt token p + 1, so a request needs the rows of
positions 0 .. len(prompt) - 2 (its last prompt row is the row it samples from, which the
step computes anyway). Prefill chunks contribute their rows in order; a request's list holds
one entry per prompt token scored so far (None for the first), so when a preemption by
recompute runs rows again, the positions already scored are skipped. A step with no such
request pending costs one check of an empty dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from vpage import _core
from vpage.engine.request_state import RequestState
from vpage.outputs import Logprob


@dataclass
class PromptRows:
    """The prompt rows of one step: ``rows`` (int64 token indices of the plan, the order their
    logits come back in), the prompt token each scores, and per request the positions
    ``[begin, end)`` whose rows it takes, in that order."""

    rows: np.ndarray
    targets: np.ndarray
    segments: list[tuple[RequestState, int, int]]


class PromptLogprobs:
    """The requests whose prompt rows are not all scored yet, by sequence id."""

    def __init__(self) -> None:
        self.pending: dict[int, RequestState] = {}
        self._texts: dict[int, Optional[str]] = {}  # token id -> decoded text (the vocabulary, at most)

    def add(self, state: RequestState) -> None:
        if state.params.prompt_logprobs is None:
            return
        state.prompt_logprobs = [None]
        if len(state.prompt_token_ids) > 1:
            for seq_id in state.seqs:
                self.pending[seq_id] = state

    def forget(self, state: RequestState) -> None:
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
        rows, targets, segments = [], [], []
        claimed: dict[str, int] = {}  # request id -> next position to score after this step's earlier rows
        for r in hits.tolist():
            state = self.pending[int(seq_ids[r])]
            begin, end = int(starts[r]), int(starts[r + 1])
            first = int(positions[begin])
            scored = claimed.get(state.request_id, len(state.prompt_logprobs) - 1)
            if first > scored:
                raise RuntimeError(f"request {state.request_id}: prompt rows from position {first} but only "
                                   f"{scored} scored (a prefix-cache hit on a prompt_logprobs request)")
            lo, hi = scored, min(first + end - begin, len(state.prompt_token_ids) - 1)
            if hi <= lo:
                continue
            rows.append(np.arange(begin + lo - first, begin + hi - first, dtype=np.int64))
            targets.append(np.asarray(state.prompt_token_ids[lo + 1:hi + 1], dtype=np.int64))
            segments.append((state, lo, hi))
            claimed[state.request_id] = hi
        if not segments:
            return None
        return PromptRows(np.concatenate(rows), np.concatenate(targets), segments)

    @torch.inference_mode()
    def score(self, logits: torch.Tensor, step: PromptRows) -> None:
        """Appends the logprobs of ``step``'s prompt tokens to their requests' lists: per token
        the prompt token's own logprob and rank (1 + the tokens with a strictly higher logprob),
        then the request's top ``prompt_logprobs`` (ranks 1, 2, ...), from the log-softmax in
        float32 of ``logits`` ``[len(step.rows), vocab]``."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        own = logprobs.gather(1, torch.from_numpy(step.targets).to(logprobs.device)[:, None])
        ranks = ((logprobs > own).sum(dim=-1) + 1).tolist()
        own = own[:, 0].tolist()
        k = min(max(state.params.prompt_logprobs for state, _, _ in step.segments), logprobs.shape[1])
        top_values, top_ids = ([], []) if k == 0 else [t.tolist() for t in logprobs.topk(k, dim=-1)]
        del logprobs
        targets = step.targets.tolist()
        row = 0
        for state, begin, end in step.segments:
            want = min(state.params.prompt_logprobs, k)
            text = self._decoder(state)
            entries = state.prompt_logprobs
            for i in range(row, row + end - begin):
                entry = {targets[i]: Logprob(own[i], ranks[i], text(targets[i]))}
                best = zip(top_ids[i][:want], top_values[i][:want]) if want else ()
                for rank, (tid, value) in enumerate(best, start=1):
                    entry.setdefault(tid, Logprob(value, rank, text(tid)))  # the prompt token keeps its entry
                entries.append(entry)
            row += end - begin
            if len(entries) == len(state.prompt_token_ids):
                self.forget(state)

    def _decoder(self, state: RequestState):
        tokenizer, texts = state.tokenizer, self._texts
        if tokenizer is None:
            return lambda tid: None

        def text(tid: int) -> Optional[str]:
            out = texts.get(tid)
            if out is None:
                out = texts[tid] = tokenizer.decode([tid])
            return out

        return text
