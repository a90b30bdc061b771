"""Everything after sampling: one home for the stop rules and the only writer of outputs.

The C++ scheduler applies the stop rules that decide when blocks are freed (EOS and stop
token ids after min_tokens, max_tokens, max_model_len) while it commits, and reports each
sequence's status and the stop token id that ended it. This module owns how those rules
read from Python and the rules only Python can check: stop strings over the detokenized
text, the end of a grammar and of a beam search (the sampler applies the min_tokens rule). It is the
only code that writes a request's per-sequence outputs (tokens, logprobs, text, finish and
stop reasons) and it builds the step's RequestOutputs, in the shape each request asked for
(``SamplingParams.output_kind``: deltas, cumulative, or only the final one).
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from vpage import _core
from vpage.engine.metrics import EngineMetrics
from vpage.engine.prompt_logprobs import PromptLogprobs
from vpage.engine.request_state import RequestState, SequenceState
from vpage.outputs import Logprob, RequestOutput
from vpage.sampler import SamplingRow
from vpage.worker.step_io import ModelRunnerOutput

_STOPPED = int(_core.SequenceStatus.FINISHED_STOPPED)
_FINISH_REASONS = {
    _STOPPED: "stop",
    int(_core.SequenceStatus.FINISHED_LENGTH): "length",
    int(_core.SequenceStatus.FINISHED_ABORTED): "abort",
    int(_core.SequenceStatus.FINISHED_IGNORED): "length",
}


class OutputProcessor:
    """Owns the unfinished requests' Python state and turns each step's samples into outputs."""

    def __init__(self, scheduler: _core.Scheduler, metrics: EngineMetrics):
        self.scheduler = scheduler
        self.metrics = metrics
        self.requests: dict[str, RequestState] = {}
        self.seq_owner: dict[int, RequestState] = {}
        self.unscheduled: dict[str, RequestState] = {}  # added, never in a step yet (queue time)
        self.prompt_logprobs = PromptLogprobs()  # requests whose prompt rows need logits

    # ------------------------------------------------------------ bookkeeping

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        self.unscheduled[state.request_id] = state
        for seq_id in state.seqs:
            self.seq_owner[seq_id] = state
        self.prompt_logprobs.add(state)

    def abort(self, request_id: str) -> None:
        """Aborts an unfinished request (unknown ids are ignored) and frees its blocks."""
        state = self.requests.get(request_id)
        if state is None:
            return
        self.scheduler.abort(request_id)
        state.finish_all("abort", time.monotonic())
        self._forget(state)

    def _forget(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        self.unscheduled.pop(state.request_id, None)
        for seq_id in state.seqs:
            self.seq_owner.pop(seq_id, None)
        self.prompt_logprobs.forget(state)

    # ------------------------------------------------------------ before sampling

    def sampling_rows(self, seq_ids: list[int]) -> list[SamplingRow]:
        """The sampler's rows for the step's sampling sequences."""
        return [self.seq_owner[seq_id].seqs[seq_id].row for seq_id in seq_ids]

    # ------------------------------------------------------------ after sampling

    def process(self, plan: _core.SchedulePlan, seq_ids: list[int], sampled: Optional[ModelRunnerOutput],
                scheduled_at: float) -> list[RequestOutput]:
        """Commits the step's tokens (beams advanced first), applies every stop rule, finishes
        requests and returns the outputs of the requests that advanced or finished.
        ``seq_ids``: the plan's sampled sequences, whose tokens ``sampled`` holds;
        ``scheduled_at``: time.monotonic() when the step was scheduled."""
        now = time.monotonic()
        if self.unscheduled and plan.num_seqs:
            self._mark_scheduled(plan, scheduled_at)
        touched: dict[str, RequestState] = {}
        finished_ids: set[str] = set()
        for request_id, _reason in plan.ignored:
            state = self.requests[request_id]
            state.finish_all("length", now)
            touched[request_id] = state
            self._forget(state)
        # (sequence, token, owner, logprob, top logprobs) to commit.
        commits: list[tuple[int, int, RequestState, float, Optional[list]]] = []
        if sampled is not None:
            commits = self._commits(seq_ids, sampled, touched, finished_ids)
        result = self.scheduler.commit(np.array([c[0] for c in commits], dtype=np.int64),
                                       np.array([c[1] for c in commits], dtype=np.int32))
        finished_ids.update(result.finished_request_ids)
        statuses = result.statuses.tolist()
        stop_tokens = result.stop_token_ids.tolist()
        for (seq_id, token, owner, logprob, top), status, stop_token in zip(commits, statuses, stop_tokens):
            touched[owner.request_id] = owner
            if owner.metrics.first_token_time is None:
                owner.metrics.first_token_time = now
            seq = owner.seqs[seq_id]
            if owner.beam is not None:
                seq.output_token_ids.append(token)
                seq.cumulative_logprob = logprob  # beams carry the cumulative value
            elif seq.finish_reason is None and self._apply_token(seq, token, logprob, top, status, stop_token):
                if self.scheduler.finish_sequence(seq_id, _core.SequenceStatus.FINISHED_STOPPED):
                    finished_ids.add(owner.request_id)
        for request_id in finished_ids:
            state = touched[request_id]
            state.finish_all("stop", now)  # every sequence already has its own reason
            self.metrics.on_request_finished(state.metrics.arrival_time, state.metrics.first_token_time,
                                             max((len(s.output_token_ids) for s in state.seqs.values()), default=0))
            self._forget(state)
        self.metrics.on_generated(len(commits))
        outputs = (state.output() for state in touched.values())
        return [out for out in outputs if out is not None]

    def _mark_scheduled(self, plan: _core.SchedulePlan, now: float) -> None:
        """Stamps first_scheduled_time on the requests this step ran for the first time (only
        while some request has never run, so a steady decode batch pays nothing)."""
        for seq_id in plan.seq_ids.tolist():
            state = self.seq_owner.get(seq_id)
            if state is not None and self.unscheduled.pop(state.request_id, None) is not None:
                state.metrics.first_scheduled_time = now
                if not self.unscheduled:
                    return

    def _commits(self, seq_ids: list[int], sampled: ModelRunnerOutput, touched: dict[str, RequestState],
                 finished_ids: set[str]) -> list[tuple[int, int, RequestState, float, Optional[list]]]:
        owners = [self.seq_owner[s] for s in seq_ids]
        for owner in dict.fromkeys(owners):
            if owner.metrics.first_token_time is None:  # read before commit may remove the group
                owner.num_cached_tokens = self.scheduler.find_group(owner.request_id).num_cached_prompt_tokens
        tokens, logprobs = sampled.token_ids, sampled.logprobs
        commits = []
        beam_rows: dict[str, list[tuple[int, int]]] = {}
        for i, (seq_id, owner) in enumerate(zip(seq_ids, owners)):
            start, count = sampled.runs[i]
            if owner.beam is not None:  # beams never speculate: one row
                beam_rows.setdefault(owner.request_id, []).append((seq_id, start))
                continue
            for r in range(start, start + count):  # accepted drafts, then the verified token
                commits.append((seq_id, tokens[r], owner, logprobs[r], sampled.top_logprobs[r]))
        for request_id, rows in beam_rows.items():
            owner = self.requests[request_id]
            touched[request_id] = owner
            beams = [(seq_id, sampled.top_logprobs[r]) for seq_id, r in rows]
            for seq_id, token, cumulative in self._advance_beams(owner, beams, finished_ids):
                commits.append((seq_id, token, owner, cumulative, None))
        return commits

    def _apply_token(self, seq: SequenceState, token: int, logprob: float, top: Optional[list[tuple[int, float]]],
                     status: int, stop_token: int) -> bool:
        """Records a committed token and the stop rules' verdict on it (the grammar of a
        structured output accepts it). Returns True when a stop string matched or the grammar
        ended (the caller finishes the sequence in the scheduler)."""
        seq.output_token_ids.append(token)
        grammar_ended = seq.constraint is not None and seq.constraint.accept(token)
        if seq.cumulative_logprob is not None:
            seq.cumulative_logprob += logprob
        if seq.logprobs is not None:
            entry = {tid: Logprob(lp, rank + 1, seq.decode_one(tid)) for rank, (tid, lp) in enumerate(top or [])}
            if token not in entry:
                entry[token] = Logprob(logprob, None, seq.decode_one(token))
            seq.logprobs.append(entry)
        stopped_by_token = status == _STOPPED
        if stopped_by_token:
            seq.stop_reason = stop_token if stop_token >= 0 else None  # None: EOS
        # EOS adds no text; a stop token id only with include_stop_str_in_output.
        if seq.detokenizer is not None and (not stopped_by_token or
                                            (seq.params.include_stop_str_in_output and seq.stop_reason is not None)):
            seq.add_text(seq.stop_matcher.feed(seq.detokenizer.add_token(token)))
        if status in _FINISH_REASONS:
            seq.finish(_FINISH_REASONS[status])
            return False
        if seq.stop_matcher.stopped:
            seq.stop_reason = seq.stop_matcher.stop_str
            seq.finish("stop")
            return True
        if grammar_ended:  # its stop token under ignore_eos, or a token outside the grammar
            seq.finish("stop")
            return True
        return False

    def _advance_beams(self, state: RequestState, beams: list[tuple[int, list]],
                       finished_ids: set[str]) -> list[tuple[int, int, float]]:
        """One beam-search step of `state` (its running beams and their top candidates):
        forks sequences whose beam continues several ways, frees the beams that lost, and
        returns the (sequence, token, cumulative logprob) pairs to commit. When the search is
        done, every beam is finished and nothing is committed."""
        search = state.beam
        running, done = search.advance(
            [(state.seqs[s].output_token_ids, state.seqs[s].cumulative_logprob, top) for s, top in beams],
            first_step=search.num_generated == 0)
        if done:
            for seq_id in list(state.seqs):
                if self.scheduler.find_sequence(seq_id) is not None:
                    self.scheduler.finish_sequence(seq_id, _core.SequenceStatus.FINISHED_STOPPED)
            finished_ids.add(state.request_id)
            return []
        used: set[int] = set()
        commits = []
        for c in running:
            target = parent = beams[c.parent][0]
            if parent in used:
                target = self.scheduler.fork_sequence(parent)
                state.fork(parent, target)
                self.seq_owner[target] = state
            used.add(parent)
            commits.append((target, c.token, c.cumulative_logprob))
        for seq_id, _ in beams:
            if seq_id not in used:
                self.scheduler.finish_sequence(seq_id, _core.SequenceStatus.FINISHED_STOPPED)
                state.drop(seq_id)
                self.seq_owner.pop(seq_id, None)
        return commits
