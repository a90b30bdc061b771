"""Request outputs as deltas, so a step's message costs what the step added, not the whole
text so far: the engine core encodes each cumulative RequestOutput against what it sent
before, the API process rebuilds the cumulative output.

A completion whose text or tokens do not extend what was sent (beams swapping places,
best_of picking its n best at the end) is sent whole, with ``reset`` set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from vpage.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class CompletionDelta:
    index: int
    reset: bool  # text, token_ids and logprobs below are whole, not appended
    text: str
    token_ids: list[int]
    logprobs: Optional[list]
    cumulative_logprob: Optional[float]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]


@dataclass
class OutputDelta:
    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int


class DeltaEncoder:
    """Engine-core side: remembers, per request, the completions last sent."""

    def __init__(self) -> None:
        self._sent: dict[str, list[CompletionOutput]] = {}

    def encode(self, out: RequestOutput) -> OutputDelta:
        before = self._sent.get(out.request_id, [])
        deltas = []
        for pos, c in enumerate(out.outputs):
            prev = before[pos] if pos < len(before) else None
            grows = (prev is not None and prev.index == c.index and c.text.startswith(prev.text)
                     and c.token_ids[:len(prev.token_ids)] == prev.token_ids
                     and (c.logprobs is None) == (prev.logprobs is None))
            start, chars = (len(prev.token_ids), len(prev.text)) if grows else (0, 0)
            deltas.append(CompletionDelta(c.index, not grows, c.text[chars:], c.token_ids[start:],
                                          None if c.logprobs is None else c.logprobs[start:],
                                          c.cumulative_logprob, c.finish_reason, c.stop_reason))
        if out.finished:
            self._sent.pop(out.request_id, None)
        else:
            self._sent[out.request_id] = out.outputs
        return OutputDelta(out.request_id, deltas, out.finished, out.metrics, out.num_cached_tokens)

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class OutputAccumulator:
    """API side, one per request: applies deltas and returns the cumulative output."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._completions: list[CompletionOutput] = []

    def apply(self, delta: OutputDelta) -> RequestOutput:
        outputs = []
        for pos, d in enumerate(delta.completions):
            prev = None if d.reset or pos >= len(self._completions) else self._completions[pos]
            if prev is None:
                text, tokens, logprobs = d.text, list(d.token_ids), None if d.logprobs is None else list(d.logprobs)
            else:
                text, tokens = prev.text + d.text, prev.token_ids + d.token_ids
                logprobs = None if d.logprobs is None else prev.logprobs + d.logprobs
            outputs.append(CompletionOutput(d.index, text, tokens, d.cumulative_logprob, logprobs, d.finish_reason,
                                            d.stop_reason))
        self._completions = outputs
        return RequestOutput(self.request_id, None, self.prompt_token_ids, outputs, delta.finished, delta.metrics,
                             delta.num_cached_tokens)
