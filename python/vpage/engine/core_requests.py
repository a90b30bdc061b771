"""The engine core's state of a request: numbers only (token ids, logprobs, the sampling row
and generator of each sample, its grammar, a beam search), and the news it reports each step
(``EngineCoreOutput``). Token ids, block tables and statuses are the C++ scheduler's; this is
what Python needs beside them to sample and to apply the rules C++ does not."""

from __future__ import annotations

from typing import Optional

import torch

from vpage.engine.beam_search import BeamSearch
from vpage.engine.core_io import EngineCoreOutput, EngineCoreRequest, PromptTokenScore, SequenceDelta
from vpage.sampler import SamplingRow, make_generator, needs_logprob
from vpage.sampling_params import SamplingParams
from vpage.structured_output import SequenceConstraint


def _sample_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request seeded with `seed` (sample 0 uses `seed` itself)."""
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 63)


class CoreSequence:
    """One sample: its tokens (for penalties, grammars and drafts), cumulative logprob, sampling
    row, grammar, finish, and what it gained since its last report."""

    def __init__(self, index: int, seq_id: int, params: SamplingParams, prompt_token_ids: list[int]):
        self.index = index
        self.seq_id = seq_id
        self.output_token_ids: list[int] = []
        # None when the request needs no logprobs (the sampler computes none for it).
        self.cumulative_logprob: Optional[float] = 0.0 if needs_logprob(params) else None
        self.row = SamplingRow(params, prompt_token_ids, self.output_token_ids)
        self.constraint: Optional[SequenceConstraint] = None  # engine/structured_outputs.py
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[int] = None
        self.stopped_by_token = False
        self._sent = 0  # output tokens already reported
        self._sent_finish = False
        self._new_logprobs: list[float] = []
        self._new_top: list[Optional[list[tuple[int, float]]]] = []

    def append(self, token: int, logprob: float, top: Optional[list[tuple[int, float]]]) -> None:
        self.output_token_ids.append(token)
        if self.cumulative_logprob is not None:
            self.cumulative_logprob += logprob
        self._new_logprobs.append(logprob)
        self._new_top.append(top)

    def finish(self, reason: str, stop_reason: Optional[int] = None, by_token: bool = False) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.stop_reason, self.stopped_by_token = reason, stop_reason, by_token

    def delta(self) -> Optional[SequenceDelta]:
        """The tokens and the finish since the last report (None when nothing is new)."""
        finishing = self.finish_reason is not None and not self._sent_finish
        if len(self.output_token_ids) == self._sent and not finishing:
            return None
        out = SequenceDelta(self.index, self.output_token_ids[self._sent:], self._new_logprobs, self._new_top,
                            self.finish_reason, self.stop_reason, self.stopped_by_token)
        self._sent, self._new_logprobs, self._new_top = len(self.output_token_ids), [], []
        self._sent_finish = self.finish_reason is not None
        return out


class CoreRequest:
    """A request in the engine core: its samples by sequence id, its beam search, its times."""

    def __init__(self, request: EngineCoreRequest, seq_ids: list[int], device: torch.device,
                 beam: Optional[BeamSearch] = None):
        self.request_id = request.request_id
        self.prompt_token_ids = request.prompt_token_ids
        self.params = request.params
        self.seqs = {sid: CoreSequence(i, sid, request.params, request.prompt_token_ids)
                     for i, sid in enumerate(seq_ids)}
        if request.params.seed is not None:
            # One generator per sample, so its draws do not depend on when it is scheduled
            # (preemption, chunking) or on the rest of the batch.
            for seq in self.seqs.values():
                seq.row.generator = make_generator(_sample_seed(request.params.seed, seq.index), device)
        self.beam = beam
        lora = request.lora_request
        self.lora_id = lora.lora_int_id if lora is not None else 0
        self.lora_name = lora.lora_name if lora is not None else None
        self.arrival_time = request.arrival_time
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.num_cached_tokens = 0
        self.finished = False
        self.finish_reason: Optional[str] = None
        # prompt_logprobs: how many prompt positions are scored (the first is never), and the
        # scores not reported yet (engine/prompt_logprobs.py).
        self.num_prompt_scored = 1
        self.new_prompt_scores: list[PromptTokenScore] = []
        self.pooling = request.pooling
        self.pooled: Optional[list[float]] = None  # the embedding of a pooling request

    def fork(self, parent: int, child: int) -> None:
        """A new beam `child` continuing `parent` (before parent's token of this step)."""
        source = self.seqs[parent]
        seq = CoreSequence(len(self.seqs), child, self.params, self.prompt_token_ids)
        seq.output_token_ids.extend(source.output_token_ids)
        seq.cumulative_logprob = source.cumulative_logprob
        seq.row.generator = source.row.generator
        self.seqs[child] = seq

    def sample(self, index: int) -> Optional[CoreSequence]:
        """The sample of ``index`` (None for a beam that is gone)."""
        return next((seq for seq in self.seqs.values() if seq.index == index), None)

    def drop(self, seq_id: int) -> None:
        """Forgets a beam that lost."""
        del self.seqs[seq_id]

    def finish_all(self, reason: str) -> None:
        """Ends the request: samples without a reason get ``reason``."""
        self.finished, self.finish_reason = True, reason
        for seq in self.seqs.values():
            seq.finish(reason)

    def output(self) -> EngineCoreOutput:
        """The news since the last report. Beam searches report only their answers, at the end."""
        out = EngineCoreOutput(self.request_id, finished=self.finished, finish_reason=self.finish_reason,
                               num_cached_tokens=self.num_cached_tokens,
                               first_scheduled_time=self.first_scheduled_time, first_token_time=self.first_token_time)
        if self.new_prompt_scores:
            out.prompt_logprobs, self.new_prompt_scores = self.new_prompt_scores, []
        if self.pooling is not None:  # its one sampled token is not an output
            out.pooled = self.pooled
            return out
        if self.beam is not None:
            if self.finished:
                out.beams = self.beam.best(self.params.n)
            return out
        for seq in self.seqs.values():
            delta = seq.delta()
            if delta is not None:
                out.seqs.append(delta)
        return out
