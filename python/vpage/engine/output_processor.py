"""The front end's half of a step: the engine core's numeric news turned into text and
``RequestOutput``s. It is the only writer of the front end's request states: per sample it
adds the new tokens' text (incremental detokenization), matches stop strings (a match ends the
sample here at once, its later tokens dropped, and is reported back so that the core ends it
too), decodes logprobs' tokens, and builds each request's output in the shape it asked for
(``SamplingParams.output_kind``: deltas, cumulative, or only the final one). It runs beside
the core in ``LLMEngine``, and in the API process for ``vpage serve``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from vpage.engine.core_io import EngineCoreOutput, PromptTokenScore
from vpage.engine.request_state import RequestState
from vpage.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput, EmbeddingRequestOutput,
                           Logprob, PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)


class OutputProcessor:
    """Owns the unfinished requests' text state and turns each step's news into outputs."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._texts: dict[int, Optional[str]] = {}  # token id -> decoded text (prompt logprobs; the vocabulary at most)

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state

    def abort(self, request_id: str) -> None:
        """Forgets an unfinished request (unknown ids are ignored); it reports nothing more."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            state.finish_all("abort", time.monotonic())

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[Any], list[tuple[str, int]]]:
        """The step's ``RequestOutput``s (of the requests that advanced or finished; an
        ``EmbeddingRequestOutput`` for a pooling request), and the (request id, sample index) of
        the samples a stop string ended, which the core must end."""
        now = time.monotonic()
        results: list[RequestOutput] = []
        stopped: list[tuple[str, int]] = []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:  # ended here already (a stop string, an abort): later news is dropped
                continue
            if out.pooled is not None:  # a pooling request: its pooled output is the whole answer
                del self.requests[out.request_id]
                results.append(_pooled_output(out.request_id, state, out.pooled))
                continue
            state.num_cached_tokens = out.num_cached_tokens
            state.metrics.first_scheduled_time = out.first_scheduled_time
            state.metrics.first_token_time = out.first_token_time
            if out.prompt_logprobs and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._prompt_entries(out.prompt_logprobs, state.params.prompt_logprobs))
            for delta in out.seqs:
                if state.seqs[delta.index].add(delta):
                    stopped.append((out.request_id, delta.index))
            if out.beams is not None:
                state.beams = out.beams
            if out.finished or state.all_finished:
                state.finish_all(out.finish_reason or "stop", now)  # samples that ended keep their reasons
                del self.requests[out.request_id]
            result = state.output()
            if result is not None:
                results.append(result)
        return results, stopped

    def _prompt_entries(self, scores: list[PromptTokenScore], num_top: int) -> list[dict[int, Logprob]]:
        """Per scored prompt position: the prompt token's own logprob and rank, then the best
        ``num_top`` tokens (ranks 1, 2, ...), each with its text."""
        entries = []
        for target, logprob, rank, top_ids, top_logprobs in scores:
            entry = {target: Logprob(logprob, rank, self._text(target))}
            for r, (tid, value) in enumerate(zip(top_ids[:num_top], top_logprobs[:num_top]), start=1):
                entry.setdefault(tid, Logprob(value, r, self._text(tid)))  # the prompt token keeps its entry
            entries.append(entry)
        return entries

    def _text(self, token: int) -> Optional[str]:
        if self.tokenizer is None:
            return None
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token])
        return text


def _pooled_output(request_id: str, state: RequestState, pooled: list[float]) -> PoolingRequestOutput:
    """The output of a pooling request by its task: an embedding, class probabilities, a score."""
    task, ids = state.pooling_task, state.prompt_token_ids
    if task == "score":
        return ScoringRequestOutput(request_id, ScoringOutput(pooled[0]), ids)
    if task == "classify":
        return ClassificationRequestOutput(request_id, ClassificationOutput(pooled), ids)
    return EmbeddingRequestOutput(request_id, EmbeddingOutput(pooled), ids)
