"""Python-side state of one request: generated tokens, text, stop strings, logprobs, and the
outputs it reports in the shape its caller asked for (``RequestOutputKind``).

Plain state: engine/output_processor.py is the only code that writes it during a step. Text
is kept as pieces and joined only when a cumulative or final output is built; a DELTA output
hands out only what arrived since the last one, so a step costs what it added."""

from __future__ import annotations

from typing import Any, Optional

import torch

from vpage.engine.beam_search import BeamSearch
from vpage.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from vpage.sampler import SamplingRow, make_generator, needs_logprob
from vpage.sampling_params import RequestOutputKind, SamplingParams
from vpage.structured_output import SequenceConstraint
from vpage.tokenizer import IncrementalDetokenizer, StopStringMatcher


def _sample_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request seeded with `seed` (sample 0 uses `seed` itself)."""
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 63)


class SequenceState:
    """One sample of a request as Python sees it (token ids and statuses live in C++)."""

    def __init__(self, index: int, seq_id: int, params: SamplingParams, prompt_token_ids: list[int],
                 tokenizer: Any):
        self.index = index
        self.seq_id = seq_id
        self.params = params
        self.output_token_ids: list[int] = []
        # None when the request needs no logprobs (the sampler computes none for it).
        self.cumulative_logprob: Optional[float] = 0.0 if needs_logprob(params) else None
        self.logprobs: Optional[list[dict[int, Logprob]]] = [] if params.logprobs is not None else None
        self.tokenizer = tokenizer
        self.detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                            if tokenizer is not None else None)
        self.stop_matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.text_parts: list[str] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason: int | str | None = None
        # A view of the prompt + output for the sampler (penalties).
        self.row = SamplingRow(params, prompt_token_ids, self.output_token_ids)
        # The grammar of a request with structured outputs (engine/structured_outputs.py).
        self.constraint: Optional[SequenceConstraint] = None
        # What earlier DELTA outputs reported: tokens, text pieces, the finish reason.
        self._sent_tokens = 0
        self._sent_parts = 0
        self._sent_finish = False

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def add_text(self, piece: str) -> None:
        if piece:
            self.text_parts.append(piece)

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.add_text(self.stop_matcher.flush())
            self.finish_reason = reason

    def decode_one(self, token: int) -> Optional[str]:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def output(self) -> CompletionOutput:
        """Everything so far (copies: later steps do not change it)."""
        return CompletionOutput(self.index, self.text, list(self.output_token_ids), self.cumulative_logprob,
                                None if self.logprobs is None else list(self.logprobs), self.finish_reason,
                                self.stop_reason)

    def delta(self) -> Optional[CompletionOutput]:
        """What arrived since the last delta (None when nothing did)."""
        tokens, parts = len(self.output_token_ids), len(self.text_parts)
        finishing = self.finish_reason is not None and not self._sent_finish
        if tokens == self._sent_tokens and parts == self._sent_parts and not finishing:
            return None
        out = CompletionOutput(self.index, "".join(self.text_parts[self._sent_parts:]),
                               self.output_token_ids[self._sent_tokens:], self.cumulative_logprob,
                               None if self.logprobs is None else self.logprobs[self._sent_tokens:],
                               self.finish_reason, self.stop_reason)
        self._sent_tokens, self._sent_parts, self._sent_finish = tokens, parts, self.finish_reason is not None
        return out


class RequestState:
    """A request's prompt, parameters, per-sample states and timestamps."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                 params: SamplingParams, seq_ids: list[int], tokenizer: Any, device: torch.device,
                 arrival_time: float, beam: Optional[BeamSearch] = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seqs = {sid: SequenceState(i, sid, params, prompt_token_ids, tokenizer) for i, sid in enumerate(seq_ids)}
        if params.seed is not None:
            # One generator per sample, so its draws do not depend on when it is scheduled
            # (preemption, chunking) or on the rest of the batch.
            for seq in self.seqs.values():
                seq.row.generator = make_generator(_sample_seed(params.seed, seq.index), device)
        self.tokenizer = tokenizer
        self.beam = beam
        self.metrics = RequestMetrics(arrival_time)
        self.num_cached_tokens = 0
        self.finished = False

    def fork(self, parent: int, child: int) -> None:
        """A new beam `child` continuing `parent` (before parent's token of this step)."""
        source = self.seqs[parent]
        seq = SequenceState(len(self.seqs), child, self.params, self.prompt_token_ids, None)
        seq.output_token_ids.extend(source.output_token_ids)
        seq.cumulative_logprob = source.cumulative_logprob
        seq.row.generator = source.row.generator
        self.seqs[child] = seq

    def drop(self, seq_id: int) -> None:
        """Forgets a beam that lost."""
        del self.seqs[seq_id]

    def finish_all(self, reason: str, now: float) -> None:
        """Finishes every sequence that has no reason yet with `reason`."""
        for seq in self.seqs.values():
            seq.finish(reason)
        self.finished = True
        self.metrics.finished_time = now

    def _beam_outputs(self) -> list[CompletionOutput]:
        decode = (lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
                  if self.tokenizer is not None else "")
        return [CompletionOutput(i, decode(h.token_ids), h.token_ids, h.cumulative_logprob, None, h.finish_reason)
                for i, h in enumerate(self.beam.best(self.params.n))]

    @property
    def chosen_at_end(self) -> bool:
        """Whether the answers are picked when the request ends (beams, best_of > n)."""
        return self.beam is not None or self.params.best_of > self.params.n

    def _cumulative(self) -> list[CompletionOutput]:
        if self.beam is not None and self.finished:
            return self._beam_outputs()
        seqs = list(self.seqs.values())
        n = self.params.n
        if self.finished and len(seqs) > n:  # best_of: keep the n most likely samples
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:n]
        else:
            seqs = seqs[:n]
        outputs = [s.output() for s in seqs]
        for i, o in enumerate(outputs):
            o.index = i
        return outputs

    def output(self) -> Optional[RequestOutput]:
        """This step's output in the shape ``params.output_kind`` asks for; None when that
        shape has nothing to report yet (FINAL_ONLY, or DELTA with answers chosen at the end,
        before the request finishes)."""
        kind = self.params.output_kind
        if kind == RequestOutputKind.CUMULATIVE or (self.chosen_at_end and self.finished):
            outputs = self._cumulative()
        elif kind == RequestOutputKind.FINAL_ONLY or self.chosen_at_end:
            if not self.finished:
                return None
            outputs = self._cumulative()
        else:
            outputs = [d for d in (s.delta() for s in self.seqs.values()) if d is not None]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.finished,
                             self.metrics, self.num_cached_tokens)
