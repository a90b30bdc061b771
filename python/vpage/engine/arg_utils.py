"""EngineArgs: every knob of an engine, validated, with the defaults a CPU or GPU user expects."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

from vpage.config import (CacheConfig, EngineConfig, KVEventsConfig, LoRAConfig, ModelConfig, ParallelConfig,
                          SchedulerConfig, SpeculativeConfig, StructuredOutputsConfig)

_PREEMPTION_MODES = ("auto", "recompute", "swap")
_EXECUTOR_BACKENDS = ("mp", "ray")
_GENERATION_CONFIG_MODES = ("auto", "vpage")
RUNNERS = ("auto", "generate", "pooling")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # generation
POOLING_MAX_NUM_BATCHED_TOKENS = 8192  # the pooling runner's (vLLM's)
STRUCTURED_OUTPUTS_BACKENDS = ("xgrammar", "llguidance")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass
class EngineArgs:
    """Arguments of ``LLMEngine`` and ``LLM`` (names follow vLLM where it has them).

    kv_cache_memory: GiB of KV cache. On CPU the default is a quarter of the available
    memory, at most 4 GiB; on CUDA the default comes from profiling a forward pass and
    ``gpu_memory_utilization`` (the fraction of the GPU's memory this engine may use: weights,
    activations and KV cache). swap_space: GiB of CPU memory for swapped-out blocks (pinned
    on CUDA). enforce_eager: never capture CUDA graphs (decode steps replay captured graphs
    on CUDA otherwise; nothing changes on CPU). kv_cache_dtype: "auto" (the model's dtype) or
    a dtype name; on CPU float16 or bfloat16 may hold the cache of float32 activations.
    speculative_config: vLLM's dict (or its JSON text), e.g. ``{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 4}`` (see ``SpeculativeConfig``).
    runner: "generate", "pooling" (embeddings, classification, scores: an encoder runs on
    ``vpage.pooling.PoolingEngine``, a decoder on this engine, its requests pooling the last
    prompt token's hidden state) or "auto" (pooling for the encoder architectures and a
    decoder's base model, as ``LLM`` resolves it). max_num_batched_tokens: None is 2048 for generation, 8192 for pooling.
    pooler_config: vLLM's pooler override, ``{"pooling_type": "CLS" | "MEAN" | "LAST",
    "normalize": bool}`` over the model's sentence-transformers configuration. hf_overrides
    (runner "pooling", vLLM's): ``{"architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}`` scores a pair by
    the last token's next-token logits (Qwen3-Reranker); see ``vpage.pooling.loader.token_classifier``.
    enable_lora: serve LoRA adapters (``LoRARequest`` per request): up to ``max_loras`` distinct
    adapters in the running batch, of rank at most ``max_lora_rank``, ``max_cpu_loras`` (default
    max_loras) kept loaded; ``lora_dtype`` "auto" is the activations' dtype (bfloat16 beside
    quantized weights on the CPU). kv_events_config: vLLM's dict (or its JSON text), e.g.
    ``{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv-events"}``:
    the prefix cache's changes published for routers (``KVEventsConfig``; needs prefix caching).
    data_parallel_size (``vpage serve``): that many engine replicas, each a whole engine (its own
    KV cache, its share of the CPU threads), behind one API server that routes each request to the
    replica holding the longest prefix of its prompt (``vpage.engine.dp_router``);
    data_parallel_backend "mp" runs the replicas as local processes, each pinned to its share of
    the cores, "ray" as Ray actors (on any node of the Ray cluster this process joins).
    kv_offloading_size (vLLM's; kv_offloading_backend "native" or None): GiB of host memory that
    keeps prefix blocks evicted from the KV cache, in one pool with ``swap_space`` (offloaded
    blocks fill its free blocks too; swapped-out requests take them back); a prompt whose prefix is there swaps it back in instead of
    computing it. kv_offloading_disk_path / kv_offloading_disk_size (GiB, default 10): a disk
    tier below it, one file per block under a folder named for the model and KV layout; a new
    engine over the same folder finds the blocks an earlier one wrote (one rank only).
    """

    model: Optional[str] = None  # None or "smollm2": the default model
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str = "auto"  # auto: GGUF weights stay quantized on CPU; none: dequantize to dtype
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None  # None: 2048 (generate), 8192 (pooling)
    max_model_len: Optional[int] = None  # default: what the model supports
    kv_cache_memory: Optional[float] = None
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"
    num_threads: Optional[int] = None  # CPU kernel threads; default torch.get_num_threads()
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages of consecutive layers (each of tensor_parallel_size ranks)
    distributed_executor_backend: Optional[str] = None  # default "mp" with more than one rank
    generation_config: str = "auto"  # the model's sampling defaults; "vpage": none; or a folder
    structured_outputs_backend: str = "xgrammar"  # grammar compiler of structured outputs
    reasoning_parser: Optional[str] = None  # e.g. "qwen3": structured outputs start after the reasoning
    speculative_config: Optional[Union[dict[str, Any], str]] = None
    runner: str = "auto"
    pooler_config: Optional[dict[str, Any]] = None
    hf_overrides: Optional[dict[str, Any]] = None  # runner "pooling": a causal LM as a token classifier
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    lora_dtype: str = "auto"
    kv_events_config: Optional[Union[dict[str, Any], str, KVEventsConfig]] = None
    data_parallel_size: int = 1  # engine replicas behind one API server (``vpage serve``)
    data_parallel_backend: str = "mp"  # the replicas as local processes ("mp") or Ray actors ("ray")
    data_parallel_rank: Optional[int] = None  # set by the server for each replica it starts
    kv_offloading_size: Optional[float] = None  # GiB of host memory for evicted prefix blocks
    kv_offloading_backend: Optional[str] = None  # "native" (ours) or None
    kv_offloading_disk_path: Optional[str] = None
    kv_offloading_disk_size: float = 10.0

    def _check_offloading(self, check) -> None:
        offload = self.kv_offloading_size is not None
        check(not offload or self.kv_offloading_size > 0,
              f"kv_offloading_size must be > 0 GiB, got {self.kv_offloading_size}")
        check(self.kv_offloading_backend in (None, "native"),
              f"kv_offloading_backend must be 'native' (vpage's own tiers), got {self.kv_offloading_backend!r}")
        check(not offload or self.enable_prefix_caching, "kv_offloading_size needs prefix caching")
        if self.kv_offloading_disk_path is None:
            return
        check(offload, "kv_offloading_disk_path needs kv_offloading_size (the disk tier lies below the CPU tier)")
        check(self.kv_offloading_disk_size > 0,
              f"kv_offloading_disk_size must be > 0 GiB, got {self.kv_offloading_disk_size}")
        check(self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1,
              "the KV disk tier runs on one rank only (tensor_parallel_size and pipeline_parallel_size 1)")

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(self.kv_cache_dtype in KV_CACHE_DTYPES,
              f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        check(self.quantization in ("auto", "none"),
              f"quantization must be 'auto' or 'none', got {self.quantization!r}")
        check(self.block_size in (8, 16, 32), f"block_size must be 8, 16 or 32, got {self.block_size}")
        check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        check(self.runner in RUNNERS, f"runner must be one of {RUNNERS}, got {self.runner!r}")
        check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
              f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        check(self.max_model_len is None or self.max_model_len >= 1,
              f"max_model_len must be >= 1, got {self.max_model_len}")
        check(self.kv_cache_memory is None or self.kv_cache_memory > 0,
              f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        check(0.0 < self.gpu_memory_utilization <= 1.0,
              f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        check(self.swap_space >= 0, f"swap_space must be >= 0 GiB, got {self.swap_space}")
        self._check_offloading(check)
        check(self.preemption_mode in _PREEMPTION_MODES,
              f"preemption_mode must be one of {_PREEMPTION_MODES}, got {self.preemption_mode!r}")
        check(self.num_threads is None or self.num_threads >= 1,
              f"num_threads must be >= 1, got {self.num_threads}")
        check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
              f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        check(isinstance(self.pipeline_parallel_size, int) and self.pipeline_parallel_size >= 1,
              f"pipeline_parallel_size must be an integer >= 1, got {self.pipeline_parallel_size!r}")
        if self.pipeline_parallel_size > 1:
            check(self.runner != "pooling", "pipeline_parallel_size applies to generation, not runner 'pooling'")
            check(not self.enable_lora, "LoRA adapters do not run under pipeline parallelism yet "
                                        "(pipeline_parallel_size 1, or tensor_parallel_size instead)")
        check(isinstance(self.data_parallel_size, int) and self.data_parallel_size >= 1,
              f"data_parallel_size must be an integer >= 1, got {self.data_parallel_size!r}")
        check(self.data_parallel_backend in _EXECUTOR_BACKENDS,
              f"data_parallel_backend must be one of {_EXECUTOR_BACKENDS}, got {self.data_parallel_backend!r}")
        check(self.data_parallel_rank is None or 0 <= self.data_parallel_rank < self.data_parallel_size,
              f"data_parallel_rank must lie in [0, {self.data_parallel_size}), got {self.data_parallel_rank!r}")
        if self.distributed_executor_backend is None and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            self.distributed_executor_backend = "mp"
        check(self.distributed_executor_backend in (None, *_EXECUTOR_BACKENDS),
              f"distributed_executor_backend must be one of {_EXECUTOR_BACKENDS}, "
              f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" or (self.data_parallel_backend == "ray"
                                                           and self.data_parallel_size > 1):
            try:
                import ray  # noqa: F401
            except ImportError:
                raise ValueError("the 'ray' backend needs Ray: pip install 'vpage[ray]'") from None
        check(self.generation_config in _GENERATION_CONFIG_MODES or os.path.isdir(self.generation_config),
              f"generation_config must be one of {_GENERATION_CONFIG_MODES} or a folder, "
              f"got {self.generation_config!r}")
        check(self.structured_outputs_backend in STRUCTURED_OUTPUTS_BACKENDS,
              f"structured_outputs_backend must be one of {STRUCTURED_OUTPUTS_BACKENDS}, "
              f"got {self.structured_outputs_backend!r}")
        check(isinstance(self.max_loras, int) and self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        check(isinstance(self.max_lora_rank, int) and self.max_lora_rank >= 1,
              f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
              f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        check(self.lora_dtype in ("auto", "float32", "float16", "bfloat16"),
              f"lora_dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {self.lora_dtype!r}")
        check(not self.enable_lora or self.runner != "pooling", "enable_lora applies to generation, not runner 'pooling'")
        check(self.data_parallel_size == 1 or self.runner != "pooling",
              "data_parallel_size applies to generation, not runner 'pooling'")
        if isinstance(self.speculative_config, str):
            try:
                self.speculative_config = json.loads(self.speculative_config)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        self._speculative = (None if self.speculative_config is None
                             else SpeculativeConfig.from_dict(self.speculative_config))
        if isinstance(self.kv_events_config, str):
            try:
                self.kv_events_config = json.loads(self.kv_events_config)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_events_config is not valid JSON: {exc}") from None
        self._kv_events = (self.kv_events_config if isinstance(self.kv_events_config, KVEventsConfig) or
                           self.kv_events_config is None else KVEventsConfig.from_dict(self.kv_events_config))
        if self._kv_events is not None and self._kv_events.enable_kv_cache_events:
            check(self.enable_prefix_caching,
                  "kv_events_config: KV cache events describe the prefix cache; enable_prefix_caching is off")
            check(self.runner != "pooling", "kv_events_config applies to generation, not runner 'pooling'")
        if not self.enable_chunked_prefill and self.max_model_len is not None and self.runner != "pooling":
            check(self._generate_batched_tokens() >= self.max_model_len,
                  "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                  f"({self._generate_batched_tokens()} < {self.max_model_len})")

    def _generate_batched_tokens(self) -> int:
        return self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS

    def create_engine_config(self) -> EngineConfig:
        """Resolves the arguments once, reading the model's config but not its weights: the
        device, the context limit (``max_model_len`` capped at what the model supports), the
        sliding window the block manager frees blocks by (when every layer has the same one), the
        model's sampling defaults (``generation_config``) and, with
        tensor parallelism, whether the model splits over the ranks. ValueError names what does
        not fit; nothing has been started then."""
        from vpage.model_executor import inspect_model, resolve_device
        from vpage.model_executor.loader.generation_config import generation_defaults
        from vpage.model_executor.pipeline_layers import pipeline_layers, pipeline_microbatches

        pooler, classifier = None, None
        if self.runner == "pooling":  # a decoder pooling through this engine (encoders: PoolingEngine)
            from vpage.pooling.loader import decoder_pooler, token_classifier

            classifier = token_classifier(self.model, self.hf_overrides)
            pooler = decoder_pooler(self.model, self.pooler_config, classifier is not None)
        elif self.hf_overrides:
            raise ValueError("hf_overrides applies to runner 'pooling' (a causal LM as a classifier)")
        device = resolve_device(self.device)
        facts = inspect_model(self.model)
        max_model_len = min(self.max_model_len or facts.max_model_len, facts.max_model_len)
        max_num_batched_tokens = self.max_num_batched_tokens or (
            POOLING_MAX_NUM_BATCHED_TOKENS if pooler is not None else DEFAULT_MAX_NUM_BATCHED_TOKENS)
        if not self.enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({max_num_batched_tokens}) "
                             f"must be >= max_model_len ({max_model_len})")
        if self.tensor_parallel_size > 1:
            facts.check_tensor_parallel(self.tensor_parallel_size)
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if world > 1 and device.type == "cuda" and self.distributed_executor_backend == "mp":
            import torch

            if torch.cuda.device_count() < world:
                raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                                 f"{self.pipeline_parallel_size} needs {world} GPUs on this machine; "
                                 f"{torch.cuda.device_count()} visible")
        pipeline = ()
        if self.pipeline_parallel_size > 1:
            if self._speculative is not None and self._speculative.model is not None:
                raise ValueError("a draft model does not run under pipeline parallelism (method 'ngram' does)")
            pipeline = pipeline_layers(facts.hf_config, self.pipeline_parallel_size)
        return EngineConfig(
            model=ModelConfig(model=self.model, dtype=self.dtype, quantization=self.quantization,
                              device=device.type, max_model_len=max_model_len, seed=self.seed,
                              generation_defaults=generation_defaults(self.model, self.generation_config),
                              pooler=pooler, classifier_token_ids=classifier[0] if classifier else None,
                              binary_classifier=bool(classifier and classifier[1])),
            cache=CacheConfig(block_size=self.block_size, kv_cache_dtype=self.kv_cache_dtype,
                              kv_cache_memory=self.kv_cache_memory,
                              gpu_memory_utilization=self.gpu_memory_utilization, swap_space=self.swap_space,
                              enable_prefix_caching=self.enable_prefix_caching,
                              sliding_window=facts.sliding_window,
                              kv_offloading_size=self.kv_offloading_size or 0.0,
                              kv_offloading_disk_path=self.kv_offloading_disk_path,
                              kv_offloading_disk_size=self.kv_offloading_disk_size),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                    distributed_executor_backend=self.distributed_executor_backend,
                                    num_threads=self.num_threads, data_parallel_rank=self.data_parallel_rank,
                                    pipeline_parallel_size=self.pipeline_parallel_size, pipeline_layers=pipeline,
                                    pipeline_microbatches=pipeline_microbatches(self.pipeline_parallel_size)),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
                                      preemption_mode=self.preemption_mode),
            enforce_eager=self.enforce_eager,
            structured_outputs=StructuredOutputsConfig(backend=self.structured_outputs_backend,
                                                       reasoning_parser=self.reasoning_parser),
            speculative=self._speculative_for(facts.sliding_window),
            lora=LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                            max_cpu_loras=self.max_cpu_loras or self.max_loras,
                            lora_dtype=self.lora_dtype) if self.enable_lora else None,
            kv_events=self._kv_events)

    def _speculative_for(self, sliding_window: Optional[int]) -> Optional[SpeculativeConfig]:
        """The speculative config, without a draft model when the target's window frees KV blocks
        (the draft's KV lives in those blocks and may reach further back)."""
        spec = self._speculative
        if spec is not None and spec.model is not None and sliding_window:
            logging.getLogger("vpage").warning(
                "vpage: speculative decoding is off: this model's sliding window frees KV blocks that a "
                "draft model's attention would read (n-gram speculation works with it)")
            return None
        return spec
