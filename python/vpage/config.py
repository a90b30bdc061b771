"""The engine's configuration, resolved once from ``EngineArgs`` and passed down unchanged.

``EngineArgs.create_engine_config()`` reads the model's facts (without its weights), resolves
"auto" choices (device, context length) and checks the combination; the executor, the workers
and the model runner read these frozen parts and never see ``EngineArgs``. Plain data: this
module imports nothing from vpage, so every layer may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Optional


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how."""

    model: Optional[str]  # None: the default model
    dtype: str  # "auto" or a dtype name (resolved by the loader against the checkpoint)
    quantization: str  # "auto": GGUF blocks stay quantized on CPU; "none": dequantize
    device: str  # "cpu" or "cuda" (resolved)
    max_model_len: int  # the engine's context limit (resolved: at most what the model supports)
    seed: int
    generation_defaults: dict[str, Any]  # SamplingParams fields the model's generation config sets
    # No tokenizer with the weights (a server's engine-core process, which handles no text; a
    # grammar that needs the vocabulary loads it then).
    skip_tokenizer_init: bool = False
    # runner "pooling" on a decoder: how its requests pool (a vpage.pooling PoolerConfig, LAST);
    # None: the engine generates.
    pooler: Optional[Any] = None
    # With a pooler, a classifier of the last token's next-token logits (Qwen3-Reranker): the
    # class token ids, and whether two of them make one score (sigmoid of their difference).
    classifier_token_ids: Optional[tuple[int, ...]] = None
    binary_classifier: bool = False


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, dtype and how much memory it may take."""

    block_size: int
    kv_cache_dtype: str  # "auto" (the activations' dtype) or a dtype name
    kv_cache_memory: Optional[float]  # GiB per rank; None: CPU default or CUDA profiling
    gpu_memory_utilization: float
    swap_space: float  # GiB of host memory for swapped-out blocks
    enable_prefix_caching: bool
    watermark: float = 0.01  # fraction of device blocks kept free when admitting prompts
    # The window W every attention layer shares (None: keep every block): a sequence's blocks
    # wholly before its next query's window are freed.
    sliding_window: Optional[int] = None
    # Tiers of the prefix cache below the device's: GiB of host memory for evicted blocks (beside
    # swap_space, in one pool), then a folder and GiB on disk (None: no disk tier).
    kv_offloading_size: float = 0.0
    kv_offloading_disk_path: Optional[str] = None
    kv_offloading_disk_size: float = 0.0


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and pipeline parallelism, CPU threads and this engine's place among data-parallel
    replicas."""

    tensor_parallel_size: int
    distributed_executor_backend: Optional[str]  # None (one process), "mp" or "ray"
    num_threads: Optional[int]  # CPU kernel threads over all ranks; None: torch's
    data_parallel_rank: Optional[int] = None  # this engine's replica index under a DP server, else None
    pipeline_parallel_size: int = 1
    # The decoder layers of each virtual stage, in model order (virtual stage j on stage
    # j % pipeline_parallel_size; summing to the model's), resolved once; () with one stage.
    pipeline_layers: tuple[int, ...] = ()
    # Micro-batches a pipelined step's sequences are cut into, so that the stages work at once.
    pipeline_microbatches: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def rank_threads(self, default: int) -> int:
        """Threads of one rank: ``num_threads`` (or ``default``) split over the ranks."""
        return max(1, (self.num_threads or default) // self.world_size)


@dataclass(frozen=True)
class SchedulerConfig:
    """What the C++ scheduler may put into one step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    preemption_mode: str  # "auto", "recompute" or "swap"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding as vLLM's ``speculative_config`` names it: each decoding sequence
    proposes up to ``num_speculative_tokens`` draft tokens, and one target forward verifies
    them. ``method`` "ngram": prompt lookup of the sequence's last ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens (in the C++ scheduler); "draft_model": greedy drafts of a
    smaller ``model`` with the same vocabulary (a folder or GGUF file; a ``model`` key alone
    means this method). No drafts in a step that starts with more than
    ``disable_by_batch_size`` running sequences (0: never off). Within k, each sequence drafts
    as many tokens as pay at its recent acceptance rate against what a draft row costs on this
    machine (measured from the engine's step times); where none pay it probes with one draft
    after 1, 3, 7, ... 32 decode steps."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 0
    model: Optional[str] = None  # the draft model (method "draft_model")

    METHODS = ("ngram", "draft_model")

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> "SpeculativeConfig":
        """Validates a ``speculative_config`` dict (vLLM's keys); ValueError names what is wrong.
        Of prompt_lookup_min/max, one given sets the other (vLLM's rule); neither: both 5."""
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
                 "model"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        model = spec.get("model")
        method = spec.get("method", "draft_model" if model is not None else None)
        if method not in cls.METHODS:
            raise ValueError(f"speculative_config: method must be one of {cls.METHODS}, got {method!r}")
        if (method == "draft_model") != (model is not None):
            raise ValueError("speculative_config: method 'draft_model' needs a 'model' (the draft), and only it")

        def integer(key: str, default: Optional[int], least: int) -> Optional[int]:
            value = spec.get(key, default)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"speculative_config: {key} must be an integer >= {least}, got {value!r}")
            return value

        k = integer("num_speculative_tokens", None, 1)
        if k is None:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        low, high = integer("prompt_lookup_min", None, 1), integer("prompt_lookup_max", None, 1)
        low, high = low or high or 5, high or low or 5
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) > prompt_lookup_max ({high})")
        return cls(method, k, low, high, integer("disable_by_batch_size", 0, 0), model)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """How grammars are compiled and which reasoning format gates them."""

    backend: str = "xgrammar"  # "xgrammar" or "llguidance"
    # vpage.reasoning parser name (e.g. "qwen3"): a constraint starts after the reasoning ends.
    reasoning_parser: Optional[str] = None


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's ``enable_lora`` and its limits): up to ``max_loras`` adapters
    in one step, each of rank at most ``max_lora_rank``, and ``max_cpu_loras`` adapters kept
    loaded (least recently used evicted; reloaded from their files when asked again)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    lora_dtype: str  # "auto" (the activations' dtype; bfloat16 beside quantized CPU weights) or a dtype name


@dataclass(frozen=True)
class KVEventsConfig:
    """Publishing the prefix cache's changes (vLLM's ``kv_events_config``, the same keys): with
    ``enable_kv_cache_events`` every block that enters or leaves the cache is sent, a batch per
    step, by the ``publisher`` ("zmq": a ZeroMQ PUB socket at ``endpoint``, bound when its host
    is ``*`` or it is ipc/inproc, else connected; "null": nowhere). ``replay_endpoint``: a ROUTER
    socket that resends the last ``buffer_steps`` batches from a sequence number; ``hwm``: the PUB
    socket's high-water mark; ``max_queue_size``: batches waiting for the publisher thread;
    ``topic``: the first frame of every message."""

    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None  # None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "KVEventsConfig":
        """Validates vLLM's keys; ValueError names what is wrong."""
        if not isinstance(values, dict):
            raise ValueError(f"kv_events_config must be a dict, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {unknown}; known: {sorted(known)}")
        config = cls(**values)
        if not isinstance(config.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config: enable_kv_cache_events must be a bool, got "
                             f"{config.enable_kv_cache_events!r}")
        publisher = config.publisher or ("zmq" if config.enable_kv_cache_events else "null")
        if publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: publisher must be 'zmq' or 'null', got {publisher!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(config, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config: {key} must be an integer >= 1, got {value!r}")
        for key in ("endpoint", "topic"):
            if not isinstance(getattr(config, key), str):
                raise ValueError(f"kv_events_config: {key} must be a string")
        return replace(config, publisher=publisher)


@dataclass(frozen=True)
class EngineConfig:
    """Every part of an engine's configuration."""

    model: ModelConfig
    cache: CacheConfig
    parallel: ParallelConfig
    scheduler: SchedulerConfig
    enforce_eager: bool  # CUDA: never capture decode graphs
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    speculative: Optional[SpeculativeConfig] = None
    lora: Optional[LoRAConfig] = None  # None: LoRA adapters are off
    kv_events: Optional[KVEventsConfig] = None  # None: no KV cache events
