"""Prometheus metrics of a pooling server, named like vLLM's with a ``vpage:`` prefix: the
requests running and waiting, prompt tokens, finished requests and their latency."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class PoolingMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, label = self.registry, ["model_name"]
        self.running = Gauge("vpage:num_requests_running", "Requests in the engine.", label,
                             registry=r).labels(model_name)
        self.waiting = Gauge("vpage:num_requests_waiting", "Requests not yet in the engine.", label,
                             registry=r).labels(model_name)
        self.prompt_tokens = Counter("vpage:prompt_tokens_total", "Prompt tokens computed.", label,
                                     registry=r).labels(model_name)
        self.success = Counter("vpage:request_success_total", "Requests finished, by finish reason.",
                               label + ["finished_reason"], registry=r).labels(model_name, "stop")
        self.prompt_sizes = Histogram("vpage:request_prompt_tokens", "Prompt tokens per request.", label,
                                      buckets=_TOKEN_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vpage:e2e_request_latency_seconds", "Arrival to the pooled output.", label,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def on_step(self, running: int, waiting: int, finished: list) -> None:
        """After an engine step: the queue sizes, and the (arrival time, output) of each
        request the step finished."""
        now = time.monotonic()
        self.running.set(running)
        self.waiting.set(waiting)
        for arrival, out in finished:
            tokens = len(out.prompt_token_ids)
            self.prompt_tokens.inc(tokens)
            self.prompt_sizes.observe(tokens)
            self.success.inc()
            self.e2e.observe(now - arrival)
