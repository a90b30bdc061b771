"""Prometheus metrics of the server, named like vLLM's with a ``vpage:`` prefix.

Engine-wide gauges and counters come from the engine core's per-step statistics (counters
advance by the difference of cumulative totals); request latencies are observed from the
timestamps the engine stamps on its outputs (``time.monotonic``, one clock per machine).
Memory is bounded: per-request state lives only while the request runs; requests are followed
through the DELTA outputs of each step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vpage.engine.core_messages import StepOutputs
from vpage.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass
class _Progress:
    counts: dict[int, int] = field(default_factory=dict)  # output tokens so far, by completion index
    reasons: dict[int, Optional[str]] = field(default_factory=dict)  # finish reasons, by index
    tokens: int = 0  # the longest completion's tokens so far
    last_time: Optional[float] = None  # when the last of them arrived
    queued: bool = False  # queue time observed
    stream: str = "false"  # the ``stream`` label: "true" for a streamed response


class ServerMetrics:
    """The metrics of one server (its own registry, so several servers can coexist)."""

    def __init__(self, model_name: str, num_engines: int = 1):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, label = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"vpage:{name}", doc, label, buckets=buckets, registry=r).labels(model_name)

        # The engine's own numbers carry an ``engine`` label, as vLLM's do: "0", or the replica's
        # index under data parallelism (sum over it for the server's total).
        engine = ["model_name", "engine"]

        def engine_gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"vpage:{name}", doc, engine, registry=r)

        def engine_counter(name: str, doc: str) -> Counter:
            return Counter(f"vpage:{name}", doc, engine, registry=r)

        self.running = engine_gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = engine_gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = engine_gauge("num_requests_swapped", "Requests swapped out to CPU memory.")
        self.kv_usage = engine_gauge("kv_cache_usage_perc", "Fraction of device KV cache blocks in use (1 = full).")
        self.cpu_usage = engine_gauge("cpu_cache_usage_perc", "Fraction of CPU swap blocks in use (1 = full).")
        self.prompt_tokens = engine_counter("prompt_tokens_total", "Prompt tokens computed (prefix-cache hits excluded).")
        self.generation_tokens = engine_counter("generation_tokens_total", "Tokens generated.")
        self.preemptions = engine_counter("num_preemptions_total", "Preemptions (recompute or swap).")
        self.cache_queries = engine_counter("prefix_cache_queries_total",
                                            "Full KV blocks of admitted prompts (all before the last token).")
        self.cache_hits = engine_counter("prefix_cache_hits_total", "KV blocks found in the prefix cache.")
        self.external_queries = engine_counter("external_prefix_cache_queries_total",
                                               "KV blocks looked up in the offloading tiers (host memory, disk).")
        self.external_hits = engine_counter("external_prefix_cache_hits_total",
                                            "KV blocks found in the offloading tiers.")
        self.spec_drafts = engine_counter("spec_decode_num_drafts", "Sequence steps that carried draft tokens.")
        self.spec_draft_tokens = engine_counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.spec_accepted = engine_counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter("vpage:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft.",
                                             ["model_name", "engine", "position"], registry=r)
        for metric in (self.running, self.waiting, self.swapped, self.kv_usage, self.cpu_usage, self.prompt_tokens,
                       self.generation_tokens, self.preemptions, self.cache_queries, self.cache_hits,
                       self.external_queries, self.external_hits, self.spec_drafts, self.spec_draft_tokens, self.spec_accepted):
            for i in range(num_engines):  # exported from the start, at zero
                metric.labels(model_name, str(i))
        self.success = Counter("vpage:request_success_total", "Requests finished, by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        # Two SLOs: a streamed response is judged by its first token (and TPOT), a whole one by
        # its last; the ``stream`` label (beyond vLLM's names) keeps them apart.
        self.ttft = Histogram("vpage:time_to_first_token_seconds", "Arrival to first token.",
                              ["model_name", "stream"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.", _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time per output token after the first.",
                              _LATENCY_BUCKETS)
        self.e2e = Histogram("vpage:e2e_request_latency_seconds", "Arrival to last token.",
                             ["model_name", "stream"], buckets=_LATENCY_BUCKETS, registry=r)
        for stream in ("true", "false"):  # exported from the start, at zero
            self.ttft.labels(model_name, stream)
            self.e2e.labels(model_name, stream)
        self.queue = histogram("request_queue_time_seconds",
                               "Arrival to the start of the step that produced the first token.", _LATENCY_BUCKETS)
        self.iteration_tokens = Histogram("vpage:iteration_tokens_total", "Tokens computed per engine step.", engine,
                                          buckets=_TOKEN_BUCKETS, registry=r)
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.request_generation = histogram("request_generation_tokens", "Generated tokens per request.",
                                            _TOKEN_BUCKETS)
        # vLLM's LoRA gauge: one series, its labels the adapters, its value when they were seen.
        self.lora_info = Gauge("vpage:lora_requests_info", "Running stats on LoRA requests.",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self._totals: dict[str, int] = {}
        self._progress: dict[str, _Progress] = {}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def forget(self, request_id: str) -> None:
        """Drops a request that ended without finishing (aborted)."""
        self._progress.pop(request_id, None)

    def on_step(self, msg: StepOutputs, outputs: list[RequestOutput], now: float, engine: int = 0) -> None:
        """A step's message and the DELTA outputs of its requests, from engine (replica) ``engine``."""
        if msg.stats is not None:
            self._engine_stats(msg.stats, str(engine))
        if msg.outputs:
            self.iteration_tokens.labels(self.model_name, str(engine)).observe(msg.step_tokens)
        for out in outputs:
            self._request(out, msg.step_start, now)
        for error in msg.errors:
            self._progress.pop(error.request_id, None)

    def _advance(self, counter, key: str, total: int) -> None:
        delta = total - self._totals.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._totals[key] = total

    def _engine_stats(self, s, engine: str) -> None:
        if s.max_lora:
            self.lora_info.clear()
            self.lora_info.labels(str(s.max_lora), ",".join(s.waiting_lora_adapters),
                                  ",".join(s.running_lora_adapters)).set(time.time())
        m = self.model_name
        self.running.labels(m, engine).set(s.num_running)
        self.waiting.labels(m, engine).set(s.num_waiting)
        self.swapped.labels(m, engine).set(s.num_swapped)
        self.kv_usage.labels(m, engine).set(s.kv_cache_usage)
        self.cpu_usage.labels(m, engine).set(s.swap_usage)
        for counter, key, total in (
                (self.prompt_tokens, "prompt", s.prefill_tokens),
                (self.generation_tokens, "generation", s.generation_tokens),
                (self.preemptions, "preempt", s.num_preempted_recompute + s.num_preempted_swap),
                (self.cache_queries, "queries", s.prefix_cache_queries),
                (self.cache_hits, "hits", s.prefix_cache_hits),
                (self.external_queries, "external_queries", s.external_prefix_cache_queries),
                (self.external_hits, "external_hits", s.external_prefix_cache_hits),
                (self.spec_drafts, "spec_drafts", s.spec_decode_num_drafts),
                (self.spec_draft_tokens, "spec_draft_tokens", s.spec_decode_num_draft_tokens),
                (self.spec_accepted, "spec_accepted", s.spec_decode_num_accepted_tokens)):
            self._advance(counter.labels(m, engine), f"{engine}:{key}", total)
        for pos, total in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            self._advance(self.spec_accepted_per_pos.labels(m, engine, str(pos)), f"{engine}:spec_pos{pos}", total)

    def _request(self, out: RequestOutput, step_start: float, now: float) -> None:
        progress = self._progress.get(out.request_id)
        if progress is None:  # aborted here while its last step was on the way
            return
        arrival = out.metrics.arrival_time
        if not progress.queued:
            progress.queued = True
            scheduled = out.metrics.first_scheduled_time or step_start
            self.queue.observe(max(scheduled - arrival, 0.0))
        for c in out.outputs:
            progress.counts[c.index] = progress.counts.get(c.index, 0) + len(c.token_ids)
            progress.reasons[c.index] = c.finish_reason
        tokens = max(progress.counts.values(), default=0)
        if tokens > progress.tokens:
            if progress.tokens == 0:
                first = out.metrics.first_token_time or now
                self.ttft.labels(self.model_name, progress.stream).observe(max(first - arrival, 0.0))
            elif progress.last_time is not None:
                per_token = (now - progress.last_time) / (tokens - progress.tokens)
                for _ in range(min(tokens - progress.tokens, 64)):
                    self.itl.observe(per_token)
            progress.tokens, progress.last_time = tokens, now
        if out.finished:
            self._progress.pop(out.request_id, None)
            finished = out.metrics.finished_time or now
            self.e2e.labels(self.model_name, progress.stream).observe(max(finished - arrival, 0.0))
            first = out.metrics.first_token_time
            if first is not None and tokens > 1:
                self.tpot.observe((finished - first) / (tokens - 1))
            reasons = set(progress.reasons.values())
            reason = "length" if reasons == {"length"} else ("abort" if "abort" in reasons else "stop")
            self.success.labels(self.model_name, reason).inc()
            self.request_generation.observe(sum(progress.counts.values()))

    def on_prompt(self, request_id: str, num_tokens: int, stream: bool) -> None:
        """Engine request ``request_id`` admitted with a prompt of ``num_tokens`` tokens, for a
        streamed response or not."""
        self.request_prompt.observe(num_tokens)
        self._progress[request_id] = _Progress(stream="true" if stream else "false")
