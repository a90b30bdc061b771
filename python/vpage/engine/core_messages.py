"""What the API process and the engine-core process send each other over ZeroMQ.

Small dataclasses pickled with the highest protocol: one message per request added (an
``EngineCoreRequest``) or aborted, one per batch of samples a stop string ended (the API
process matches stop strings), one :class:`StepOutputs` per engine step (the step's
``EngineCoreOutput``s: token ids and numbers, no text), one :class:`CoreReady` at start-up. Both ends are processes of the same
vpage install, and the sockets live in a private temporary folder, so pickle is safe here.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Optional

from vpage.engine.core_io import EngineCoreOutput
from vpage.engine.metrics import EngineStats


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class FinishSequences:
    """Samples (request id, sample index) that a stop string ended in the API process."""

    samples: list[tuple[str, int]]


@dataclass
class LoraCommand:
    """Load (``add``) or forget (``remove``, an adapter id) a LoRA adapter; the core answers with
    a ``CommandReply`` of the same ``reply_id``."""

    reply_id: str
    add: Optional[Any] = None  # a LoRARequest
    remove: Optional[int] = None


@dataclass
class ResetPrefixCache:
    """Empty the prefix cache (vLLM's reset_prefix_cache); the core answers with a
    ``CommandReply`` (status 409 while requests hold KV blocks)."""

    reply_id: str


@dataclass
class CommandReply:
    """The outcome of a command: ``error`` None when it worked, else why not, with the HTTP
    status it stands for (400: a bad adapter, 404: no such files or adapter, 409: a cache in use)."""

    reply_id: str
    error: Optional[str] = None
    status: int = 200


@dataclass
class CoreReady:
    """Sent once the engine is built: what the API process needs to validate requests (it
    loads the tokenizer itself: the core process has none)."""

    max_model_len: int
    max_prompt_tokens: int  # longest prompt that leaves room for one generated token
    vocab_size: int
    max_num_seqs: int
    generation_defaults: dict[str, Any]  # the model's sampling defaults (--generation-config)


@dataclass
class CoreFailed:
    """Sent instead of CoreReady when the engine cannot be built (bad model, no memory)."""

    message: str


@dataclass
class RequestError:
    """A request the engine refused (``status`` 400) or lost in a failed step (500)."""

    request_id: str
    status: int
    message: str


@dataclass
class StepOutputs:
    """One step (or an idle heartbeat when ``outputs`` and ``errors`` are empty)."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    stats: Optional[EngineStats] = None  # only every STATS_INTERVAL_S, and when requests end
    step_start: float = 0.0  # time.monotonic() when the step began
    step_tokens: int = 0  # tokens the step computed (prompt and generated)
    replies: list[CommandReply] = field(default_factory=list)  # answers to commands (LoraCommand)
    kv_events: list[dict] = field(default_factory=list)  # a data-parallel replica's KV cache events (wire maps)


def encode(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    return pickle.loads(data)
