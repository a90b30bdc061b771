"""Request outputs, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class Logprob:
    """Log-probability of one token, and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, Logprob]]]  # per token, when SamplingParams.logprobs is set
    finish_reason: Optional[str] = None  # "stop", "length", "abort" or None while running
    stop_reason: Union[int, str, None] = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of a request (time.monotonic seconds)."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    """A request after a step. Its completions are cumulative, deltas (what the step added;
    only the completions that changed) or final, as ``SamplingParams.output_kind`` asked."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: Optional[list[int]]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    # With SamplingParams.prompt_logprobs: per prompt token, None for the first, then its top
    # logprobs and its own (given once, in the first output of a request, also under DELTA).
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    lora_request: Optional[Any] = None  # the LoRARequest it ran under (None: the base model)


class _CompletionParts:
    """One completion's pieces, appended as deltas arrive."""

    def __init__(self, index: int):
        self.index = index
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[dict[int, Logprob]]] = None
        self.last: Optional[CompletionOutput] = None  # the latest delta (reasons, cumulative logprob)

    def add(self, delta: CompletionOutput) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.last = delta

    def output(self) -> CompletionOutput:
        last = self.last
        return CompletionOutput(self.index, "".join(self.text), self.token_ids, last.cumulative_logprob,
                                self.logprobs, last.finish_reason, last.stop_reason)


class OutputAccumulator:
    """Adds up a request's DELTA outputs; ``output()`` is what they add up to (a cumulative
    output; ``request_id``'s prompt ids as given). Linear in what arrives."""

    def __init__(self, request_id: str, prompt_token_ids: Optional[list[int]] = None):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._parts: dict[int, _CompletionParts] = {}
        self._last: Optional[RequestOutput] = None
        self._prompt_logprobs = None  # the one delta that carries them (the first)

    @property
    def empty(self) -> bool:
        return self._last is None

    def add(self, delta: RequestOutput) -> None:
        for c in delta.outputs:
            parts = self._parts.get(c.index)
            if parts is None:
                parts = self._parts[c.index] = _CompletionParts(c.index)
            parts.add(c)
        self._last = delta
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs

    def output(self) -> RequestOutput:
        last = self._last
        completions = [self._parts[i].output() for i in sorted(self._parts)]
        return RequestOutput(self.request_id, last.prompt, self.prompt_token_ids, completions, last.finished,
                             last.metrics, last.num_cached_tokens, self._prompt_logprobs, last.lora_request)


# ---------------------------------------------------------------- pooling (vLLM's names)

@dataclass
class PoolingOutput:
    """The pooled tensor of a request (``LLM.encode``): an embedding or class probabilities."""

    data: Any  # torch.Tensor, float32, 1-D


@dataclass
class EmbeddingOutput:
    """One embedding."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """Class probabilities (or logits, with ``use_activation=False``), one per label."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """The score of a text pair: a cross-encoder's, or the cosine similarity of two embeddings."""

    score: float


@dataclass
class PoolingRequestOutput:
    """A finished pooling request; ``outputs`` is one of the outputs above."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    outputs: ScoringOutput
