"""The engine core in-process (no sockets): a failing step fails only its live requests and
the engine goes on; and the bounded latency histogram behind get_stats' percentiles."""

from __future__ import annotations

import random
import time

import pytest

from model_fixtures import save_tiny_model
from vpage import SamplingParams
from vpage.engine import EngineArgs, LLMEngine
from vpage.engine.core_messages import AddRequest, decode, encode
from vpage.engine.engine_core import EngineCore
from vpage.engine.latency_histogram import LatencyHistogram
from vpage.engine.output_delta import DeltaEncoder, OutputAccumulator
from vpage.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-core")
    save_tiny_model("llama", folder)
    return EngineCore(LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", kv_cache_memory=0.02)))


def add(core: EngineCore, rid: str, max_tokens: int = 4):
    return core.add(AddRequest(rid, [5, 6, 7], SamplingParams(temperature=0, max_tokens=max_tokens),
                               time.monotonic()))


def run(core: EngineCore) -> dict:
    """Steps to the end; the final outputs rebuilt from the deltas that cross the socket."""
    finished, accumulators = {}, {}
    while core.engine.has_unfinished_requests():
        for delta in decode(encode(core.step())).outputs:
            acc = accumulators.setdefault(delta.request_id, OutputAccumulator(delta.request_id, [5, 6, 7]))
            out = acc.apply(delta)
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_a_failing_step_fails_only_its_running_requests_and_the_engine_goes_on(core, monkeypatch):
    assert add(core, "a") is None and add(core, "b") is None
    core.step()  # a and b are running now
    assert add(core, "c") is None  # c waits
    real_step = core.engine.step

    def broken_step():
        raise RuntimeError("injected failure at /some/path")

    monkeypatch.setattr(core.engine, "step", broken_step)
    out = core.step()
    assert sorted(e.request_id for e in out.errors) == ["a", "b"] and {e.status for e in out.errors} == {500}
    assert "/some/path" not in out.errors[0].message and core.live == {"c"}
    monkeypatch.setattr(core.engine, "step", real_step)
    finished = run(core)
    assert len(finished["c"].outputs[0].token_ids) == 4 and core.failed_steps == 0
    assert core.engine.get_stats().kv_cache_usage == 0


def test_a_step_failing_before_anything_runs_fails_every_live_request(core, monkeypatch):
    assert add(core, "d") is None

    def broken_step():
        raise RuntimeError("injected failure")

    monkeypatch.setattr(core.engine, "step", broken_step)
    assert [e.request_id for e in core.step().errors] == ["d"]
    assert not core.engine.has_unfinished_requests() and not core.live


def test_a_refused_request_is_a_400_and_changes_nothing(core):
    error = core.add(AddRequest("bad", [10**6], SamplingParams(), time.monotonic()))
    assert error.status == 400 and "out of range" in error.message
    assert not core.engine.has_unfinished_requests() and "bad" not in core.live


def test_latency_histogram_percentiles_are_close_and_memory_is_fixed():
    rng = random.Random(0)
    samples = [rng.lognormvariate(-3, 1) for _ in range(20000)]
    hist = LatencyHistogram()
    size = len(hist._counts)
    for x in samples:
        hist.add(x)
    assert len(hist._counts) == size
    samples.sort()
    for q in (50, 95, 99):
        exact = samples[int(q / 100 * len(samples)) - 1]
        assert abs(hist.percentile(q) - exact) / exact < 0.07
    assert abs(hist.mean() - sum(samples) / len(samples)) < 1e-9
    assert LatencyHistogram().percentile(50) is None
    stats_fields = {"ttft_percentiles_s", "tpot_percentiles_s", "prefix_cache_queries", "prefix_cache_hits"}
    from vpage.engine.metrics import EngineStats

    assert stats_fields <= set(EngineStats.__dataclass_fields__)


def test_output_deltas_rebuild_cumulative_outputs_including_resets():
    def out(texts, tokens, finished=False, logprobs=False):
        comps = [CompletionOutput(i, t, list(k), -1.0, [{x: Logprob(-0.5)} for x in k] if logprobs else None)
                 for i, (t, k) in enumerate(zip(texts, tokens))]
        return RequestOutput("r", None, [], comps, finished, RequestMetrics(0.0))

    steps = [out(["a"], [[1]], logprobs=True), out(["ab"], [[1, 2]], logprobs=True),
             out(["ab!"], [[1, 2, 3]], logprobs=True),
             out(["x", "y"], [[7], [8, 9]]),  # a different shape: sent whole
             out(["xz", "q"], [[7, 4], [5]], finished=True)]  # second sample swapped: reset
    encoder, acc = DeltaEncoder(), OutputAccumulator("r", [1])
    for step in steps:
        delta = decode(encode(encoder.encode(step)))
        got = acc.apply(delta)
        assert [(c.text, c.token_ids) for c in got.outputs] == [(c.text, c.token_ids) for c in step.outputs]
        assert [c.logprobs for c in got.outputs] == [c.logprobs for c in step.outputs]
    assert [d.reset for d in encoder.encode(steps[1]).completions] == [True]  # forgotten after finishing
    assert len(encoder.encode(out(["abc"], [[1, 2, 3]])).completions[0].token_ids) == 3
