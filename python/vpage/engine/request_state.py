"""The front end's state of one request: its text. Per sample the tokens the core reported,
their text (incremental detokenization, stop strings, the held-back tail), logprobs with each
token's text, and the outputs it reports in the shape its caller asked for
(``RequestOutputKind``).

Plain state: engine/output_processor.py is the only code that writes it. Text is kept as pieces
and joined only when a cumulative or final output is built; a DELTA output hands out only what
arrived since the last one, so a step costs what it added."""

from __future__ import annotations

from typing import Any, Optional

from vpage.engine.beam_search import BeamHypothesis
from vpage.engine.core_io import SequenceDelta
from vpage.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from vpage.sampler import needs_logprob
from vpage.sampling_params import RequestOutputKind, SamplingParams
from vpage.tokenizer import IncrementalDetokenizer, StopStringMatcher


class SequenceState:
    """One sample of a request as the front end sees it."""

    def __init__(self, index: int, params: SamplingParams, prompt_token_ids: list[int], tokenizer: Any):
        self.index = index
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

    def add(self, delta: SequenceDelta) -> bool:
        """Adds a step's news of this sample: tokens, their logprobs and text, its finish.
        Returns True when a stop string ended it (its later tokens are dropped; the caller tells
        the core). A finished sample takes nothing more."""
        last = len(delta.token_ids) - 1
        for i, token in enumerate(delta.token_ids):
            if self.finish_reason is not None:
                return False
            self._add_token(token, delta.logprobs[i], delta.top_logprobs[i])
            ending = i == last and delta.finish_reason is not None
            by_token = ending and delta.stopped_by_token
            if by_token:
                self.stop_reason = delta.stop_reason  # None: EOS
            # EOS adds no text; a stop token id only with include_stop_str_in_output.
            if self.detokenizer is not None and (not by_token or
                                                 (self.params.include_stop_str_in_output and self.stop_reason is not None)):
                self.add_text(self.stop_matcher.feed(self.detokenizer.add_token(token)))
            if ending and (by_token or delta.finish_reason != "stop"):  # the scheduler's rules win
                self.finish(delta.finish_reason)
                return False
            if self.stop_matcher.stopped:
                self.stop_reason = self.stop_matcher.stop_str
                self.finish("stop")
                return True
            if ending:  # a grammar that ended
                self.finish(delta.finish_reason)
        if not delta.token_ids and delta.finish_reason is not None:
            self.finish(delta.finish_reason)
        return False

    def _add_token(self, token: int, logprob: float, top: Optional[list[tuple[int, float]]]) -> None:
        self.output_token_ids.append(token)
        if self.cumulative_logprob is not None:
            self.cumulative_logprob += logprob
        if self.logprobs is not None:
            entry = {tid: Logprob(lp, rank + 1, self.decode_one(tid)) for rank, (tid, lp) in enumerate(top or [])}
            if token not in entry:
                entry[token] = Logprob(logprob, None, self.decode_one(token))
            self.logprobs.append(entry)

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
                 params: SamplingParams, tokenizer: Any, arrival_time: float):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        # Beam searches report only their answers, at the end (``beams``).
        self.seqs = [SequenceState(i, params, prompt_token_ids, tokenizer if not params.use_beam_search else None)
                     for i in range(params.best_of)]
        self.tokenizer = tokenizer
        self.beams: Optional[list[BeamHypothesis]] = None
        self.metrics = RequestMetrics(arrival_time)
        self.num_cached_tokens = 0
        self.lora_request: Optional[Any] = None  # the LoRARequest it runs under, echoed in its outputs
        self.pooling_task: Optional[str] = None  # a pooling request's task ("embed", "classify", "score")
        self.finished = False
        # With params.prompt_logprobs: per prompt token scored so far (None for the first);
        # the output processor fills it. A DELTA output hands it out once, then drops it.
        self.prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = (
            [None] if params.prompt_logprobs is not None else None)

    @property
    def all_finished(self) -> bool:
        """Whether every sample has ended (a beam search ends as a whole)."""
        return not self.params.use_beam_search and all(s.finish_reason is not None for s in self.seqs)

    def finish_all(self, reason: str, now: float) -> None:
        """Finishes every sequence that has no reason yet with `reason`."""
        for seq in self.seqs:
            seq.finish(reason)
        self.finished = True
        self.metrics.finished_time = now

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _beam_outputs(self) -> list[CompletionOutput]:
        return [CompletionOutput(i, self._decode(h.token_ids), h.token_ids, h.cumulative_logprob, None,
                                 h.finish_reason) for i, h in enumerate(self.beams or [])]

    @property
    def chosen_at_end(self) -> bool:
        """Whether the answers are picked when the request ends (beams, best_of > n)."""
        return self.params.use_beam_search or self.params.best_of > self.params.n

    def _cumulative(self) -> list[CompletionOutput]:
        if self.params.use_beam_search and self.finished:
            return self._beam_outputs()
        seqs = self.seqs
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
            outputs = [d for d in (s.delta() for s in self.seqs) if d is not None]
        prompt_logprobs = self.prompt_logprobs
        if kind == RequestOutputKind.DELTA:
            self.prompt_logprobs = None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.finished,
                             self.metrics, self.num_cached_tokens, prompt_logprobs, self.lora_request)
