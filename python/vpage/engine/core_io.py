"""What the front end and the engine core hand each other: numbers only, never text.

In: an ``EngineCoreRequest`` per request (token ids, parameters, arrival), aborts, and the
sequences that a stop string finished (the front end matches stop strings; the core then
drops the sequence's later tokens). Out: per step, one ``EngineCoreOutput`` for each request
that advanced or ended, with each sample's new tokens, their logprobs and its finish, the
prompt logprobs scored this step, a beam search's answers when it ends, and a pooling
request's embedding. Between processes
these travel pickled (``core_messages``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from vpage.engine.beam_search import BeamHypothesis
from vpage.lora.request import LoRARequest
from vpage.pooling_params import PoolingParams
from vpage.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """A tokenized, validated request."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() (one clock for every process of the machine)
    cache_salt: Optional[str] = None
    # A pooling request (an engine started with runner "pooling"): its prompt is prefilled and
    # its last token's final hidden state pooled; ``params`` are ignored.
    pooling: Optional[PoolingParams] = None
    lora_request: Optional[LoRARequest] = None  # the LoRA adapter it runs under (None: the base model)


@dataclass
class SequenceDelta:
    """What one sample of a request gained in a step."""

    index: int  # the sample's index in its request
    token_ids: list[int]
    logprobs: list[float]  # per new token under the model (NaN where the request needs none)
    top_logprobs: list[Optional[list[tuple[int, float]]]]  # per new token, (id, logprob) best first, when asked
    finish_reason: Optional[str] = None  # "stop", "length" or "abort" when the sample ended this step
    stop_reason: Optional[int] = None  # the stop token id that ended it (None: EOS, or another reason)
    stopped_by_token: bool = False  # its last token is the EOS or stop token id that ended it


# One scored prompt position: (prompt token, its logprob, its rank, the top token ids, their logprobs).
PromptTokenScore = tuple[int, float, int, list[int], list[float]]


@dataclass
class EngineCoreOutput:
    """A request's news from one step."""

    request_id: str
    seqs: list[SequenceDelta] = field(default_factory=list)
    finished: bool = False
    # The reason of every sample that has none when the request ends ("length" for a request the
    # scheduler ignored, "stop" when a beam search or a stop string ended it).
    finish_reason: Optional[str] = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    prompt_logprobs: list[PromptTokenScore] = field(default_factory=list)  # positions scored this step, in order
    beams: Optional[list[BeamHypothesis]] = None  # a beam search's n best, when it ends
    pooled: Optional[list[float]] = None  # a pooling request's embedding, when it ends
