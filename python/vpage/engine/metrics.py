"""Engine statistics: cheap counters updated once per step; the snapshot (with its
percentiles) is computed only when asked for. Memory is constant: latencies go into bounded
histograms, not lists."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from vpage import _core
from vpage.engine.latency_histogram import LatencyHistogram
from vpage.spec_decode.metrics import SpecDecodeStats

_PERCENTILES = (50, 95, 99)


@dataclass
class EngineStats:
    """A snapshot of the engine's counters since it started."""

    num_steps: int
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # fraction of device KV blocks in use (cached free blocks excluded)
    swap_usage: float  # fraction of CPU swap blocks in use
    num_preempted_recompute: int
    num_preempted_swap: int
    prefix_cache_hit_rate: float  # hit blocks / queried blocks
    prefix_cache_queries: int  # full blocks of admitted prompts, all before each one's last token
    prefix_cache_hits: int  # blocks found in the cache
    # The offloading tiers (kv_offloading_size, a disk path), vLLM's external prefix cache:
    # blocks looked up there after the device cache missed, and found (a block read from the
    # disk is found in host memory, where admission takes it).
    external_prefix_cache_queries: int
    external_prefix_cache_hits: int
    prefill_tokens: int  # tokens computed in rows of several tokens (prefix-cache hits excluded)
    generation_tokens: int
    generation_tokens_per_s: float  # over the time spent inside step()
    mean_ttft_s: Optional[float]  # arrival -> first token, over finished requests
    mean_tpot_s: Optional[float]  # time per output token after the first, over finished requests
    ttft_percentiles_s: dict[int, Optional[float]]  # {50: P50, 95: P95, 99: P99}, ~6% precision
    tpot_percentiles_s: dict[int, Optional[float]]
    # Speculative decoding (vLLM's spec_decode_* counters): rows that carried drafts, draft
    # tokens, accepted ones, and accepted ones by position in the draft.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # LoRA (vLLM's lora_requests_info): max_loras (0: LoRA off), and the adapters of the
    # unfinished requests that have run and of those that have not yet, by name.
    max_lora: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()


class EngineMetrics:
    """Accumulates per-step and per-request timings."""

    def __init__(self) -> None:
        self.step_time = 0.0
        self.generation_tokens = 0
        self.last_step_tokens = 0  # tokens the last step computed (prompt and generated)
        self.ttft = LatencyHistogram()
        self.tpot = LatencyHistogram()
        self.spec = SpecDecodeStats()

    def on_step(self, seconds: float, num_tokens: int) -> None:
        self.step_time += seconds
        self.last_step_tokens = num_tokens

    def on_generated(self, num_tokens: int) -> None:
        self.generation_tokens += num_tokens

    def on_request_finished(self, arrival: float, first_token: Optional[float], num_tokens: int) -> None:
        if first_token is None:
            return
        self.ttft.add(first_token - arrival)
        if num_tokens > 1:
            self.tpot.add((time.monotonic() - first_token) / (num_tokens - 1))

    def snapshot(self, scheduler: _core.Scheduler) -> EngineStats:
        usage = scheduler.usage()
        stats = scheduler.stats
        cache = usage.prefix_cache
        return EngineStats(
            num_steps=stats.num_steps,
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting,
            num_swapped=scheduler.num_swapped,
            kv_cache_usage=1.0 - usage.free_gpu_blocks / max(usage.num_gpu_blocks, 1),
            swap_usage=1.0 - usage.free_cpu_blocks / max(usage.num_cpu_blocks, 1) if usage.num_cpu_blocks else 0.0,
            num_preempted_recompute=stats.num_preempted_recompute,
            num_preempted_swap=stats.num_preempted_swap,
            prefix_cache_hit_rate=cache.hits / cache.queries if cache.queries else 0.0,
            prefix_cache_queries=cache.queries,
            prefix_cache_hits=cache.hits,
            external_prefix_cache_queries=usage.cpu_prefix_cache.queries,
            external_prefix_cache_hits=usage.cpu_prefix_cache.hits,
            prefill_tokens=stats.num_prefill_tokens,
            generation_tokens=self.generation_tokens,
            generation_tokens_per_s=self.generation_tokens / self.step_time if self.step_time else 0.0,
            mean_ttft_s=self.ttft.mean(),
            mean_tpot_s=self.tpot.mean(),
            ttft_percentiles_s={q: self.ttft.percentile(q) for q in _PERCENTILES},
            tpot_percentiles_s={q: self.tpot.percentile(q) for q in _PERCENTILES},
            spec_decode_num_drafts=self.spec.num_drafts,
            spec_decode_num_draft_tokens=self.spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(self.spec.accepted_per_pos),
        )
