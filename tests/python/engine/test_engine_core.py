"""The engine core in-process (no sockets): a failing step fails only its live requests and
the engine goes on; the numbers that cross the socket make the same outputs as LLMEngine's;
outputs in every RequestOutputKind agree; the server's core process holds no tokenizer for
plain requests; and the bounded latency histogram behind get_stats' percentiles."""

from __future__ import annotations

import random
import time

import pytest

from model_fixtures import save_tiny_model
from vpage import SamplingParams, StructuredOutputsParams
from vpage.engine import EngineArgs, LLMEngine
from vpage.engine.core_io import EngineCoreRequest
from vpage.engine.core_messages import FinishSequences, decode, encode
from vpage.engine.core_process import EngineCoreProc, build_engine_core
from vpage.engine.latency_histogram import LatencyHistogram
from vpage.engine.output_processor import OutputProcessor
from vpage.engine.request_state import RequestState
from vpage.model_executor.loader.model_loader import load_tokenizer
from vpage.outputs import OutputAccumulator
from vpage.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-core")
    save_tiny_model("llama", folder)
    return LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", kv_cache_memory=0.02))


@pytest.fixture
def core(engine):
    """The engine-core process's loop object over the engine's core, and (``front``) an API
    process's output processor."""
    proc = EngineCoreProc(engine.core)
    proc.front = OutputProcessor(engine.tokenizer)
    return proc


def add(core: EngineCoreProc, rid: str, max_tokens: int = 4, prompt=(5, 6, 7), **params):
    params = SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA,
                            **{"temperature": 0, **params})
    error = core.add(EngineCoreRequest(rid, list(prompt), params, time.monotonic()))
    if error is None:
        core.front.add(RequestState(rid, None, list(prompt), params, core.front.tokenizer, time.monotonic()))
    return error


def run(core: EngineCoreProc) -> dict:
    """Steps to the end, as the two processes do: the final outputs that the API process's
    deltas add up to, made of the numbers that cross the socket (stop strings sent back)."""
    finished, accumulators = {}, {}
    for _ in range(1000):
        if not core.core.has_unfinished_requests():
            break
        outputs, stopped = core.front.process(decode(encode(core.step())).outputs)
        if stopped:
            core.finish(decode(encode(FinishSequences(stopped))).samples)
        for delta in outputs:
            acc = accumulators.setdefault(delta.request_id, OutputAccumulator(delta.request_id, delta.prompt_token_ids))
            acc.add(delta)
            if delta.finished:
                finished[delta.request_id] = acc.output()
    assert not core.core.has_unfinished_requests() and not core.live and not core.front.requests
    return finished


def test_a_failing_step_fails_only_its_running_requests_and_the_engine_goes_on(core, monkeypatch):
    assert add(core, "a") is None and add(core, "b") is None
    core.step()  # a and b are running now
    assert add(core, "c") is None  # c waits
    real_step = core.core.step

    def broken_step():
        raise RuntimeError("injected failure at /some/path")

    monkeypatch.setattr(core.core, "step", broken_step)
    out = core.step()
    assert sorted(e.request_id for e in out.errors) == ["a", "b"] and {e.status for e in out.errors} == {500}
    assert "/some/path" not in out.errors[0].message and core.live == {"c"}
    for error in out.errors:
        core.front.abort(error.request_id)
    monkeypatch.setattr(core.core, "step", real_step)
    finished = run(core)
    assert len(finished["c"].outputs[0].token_ids) == 4 and core.failed_steps == 0
    assert core.core.get_stats().kv_cache_usage == 0


def test_a_step_failing_before_anything_runs_fails_every_live_request(core, monkeypatch):
    assert add(core, "d") is None

    def broken_step():
        raise RuntimeError("injected failure")

    monkeypatch.setattr(core.core, "step", broken_step)
    assert [e.request_id for e in core.step().errors] == ["d"]
    assert not core.core.has_unfinished_requests() and not core.live


def test_a_refused_request_is_a_400_and_changes_nothing(core):
    delta = SamplingParams(output_kind=RequestOutputKind.DELTA)
    error = core.add(EngineCoreRequest("bad", [10**6], delta, time.monotonic()))
    assert error.status == 400 and "out of range" in error.message
    assert not core.core.has_unfinished_requests() and "bad" not in core.live


def test_the_split_processes_make_llm_engines_outputs(core, engine):
    # Stop strings (matched in the API process, sent back), n > 1 with seeds, logprobs, and a
    # request that a stop string ends while its other sample goes on: the outputs made of the
    # core's numbers after a trip through pickle equal the in-process LLMEngine's.
    cases = {
        "stop": dict(max_tokens=40, stop=["b"], include_stop_str_in_output=True),
        "samples": dict(temperature=1.0, seed=11, n=3, max_tokens=12, logprobs=2, stop=["a"]),
        "plain": dict(max_tokens=9, logprobs=1),
    }
    prompts = {"stop": (5, 6, 7, 8), "samples": (9, 10), "plain": (11, 12, 13)}
    for rid, params in cases.items():
        assert add(core, rid, prompt=prompts[rid], **params) is None
    split = run(core)
    for rid, params in cases.items():
        engine.add_request(rid, list(prompts[rid]), SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY,
                                                                   **{"temperature": 0, **params}))
    local = {o.request_id: o for o in _drain(engine)}
    shape = {rid: [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob,
                    c.logprobs) for c in out.outputs] for rid, out in split.items()}
    assert shape == {rid: [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob,
                            c.logprobs) for c in out.outputs] for rid, out in local.items()}
    assert any(c.finish_reason == "stop" and isinstance(c.stop_reason, str)
               for out in split.values() for c in out.outputs)


def _drain(engine: LLMEngine) -> list:
    outputs = []
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return outputs
        outputs += engine.step()
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("params", [
    dict(temperature=0, max_tokens=12, logprobs=2),
    dict(temperature=1.0, seed=3, n=3, max_tokens=10, logprobs=1, stop=["ab"], min_tokens=2),
])
def test_output_kinds_agree_and_deltas_carry_only_news(engine, params):
    finals = {}
    for kind in RequestOutputKind:
        engine.add_request(kind.name, [5, 6, 7, 8], SamplingParams(output_kind=kind, **params))
        outputs = _drain(engine)
        assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outputs) == 1
            finals[kind] = outputs[0]
        elif kind == RequestOutputKind.CUMULATIVE:
            finals[kind] = outputs[-1]
        else:
            acc = OutputAccumulator(kind.name, [5, 6, 7, 8])
            seen: dict[int, int] = {}
            for out in outputs:
                for c in out.outputs:
                    # a decode step adds one token per sequence; nothing sent before is repeated
                    assert len(c.token_ids) <= 1 and len(c.logprobs) == len(c.token_ids)
                    seen[c.index] = seen.get(c.index, 0) + len(c.token_ids)
                acc.add(out)
            finals[kind] = acc.output()
            assert seen == {c.index: len(c.token_ids) for c in finals[kind].outputs}
    shapes = {kind: [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
                      [sorted(e) for e in c.logprobs]) for c in out.outputs] for kind, out in finals.items()}
    assert shapes[RequestOutputKind.DELTA] == shapes[RequestOutputKind.CUMULATIVE] == \
        shapes[RequestOutputKind.FINAL_ONLY]
    assert len(shapes[RequestOutputKind.DELTA]) == params.get("n", 1)


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


def test_the_core_process_has_no_tokenizer_after_plain_requests(engine):
    # Built as `vpage serve` builds its engine-core process: plain requests, their text made on
    # the API's side, leave it without a tokenizer; a grammar loads one for itself.
    folder = engine.config.model.model
    proc = EngineCoreProc(build_engine_core(EngineArgs(model=folder, dtype="float32", device="cpu",
                                                       kv_cache_memory=0.02)))
    proc.front = OutputProcessor(load_tokenizer(folder))
    try:
        assert proc.core.executor.tokenizer is None and proc.core.model_config.eos_token_ids == \
            engine.model_config.eos_token_ids
        for rid, params in {"p": dict(max_tokens=6, logprobs=2), "s": dict(max_tokens=30, stop=["a"], n=2,
                                                                           temperature=1.0, seed=1)}.items():
            assert add(proc, rid, **params) is None
        finished = run(proc)
        assert sorted(finished) == ["p", "s"] and finished["p"].outputs[0].text
        assert proc.core.tokenizer is None and proc.core.structured._compiler is None
        so = StructuredOutputsParams(choice=["yes", "no"])
        assert add(proc, "g", max_tokens=8, structured_outputs=so) is None
        assert run(proc)["g"].outputs[0].text in ("yes", "no")
        assert proc.core.tokenizer is None and proc.core.structured.compiler.tokenizer is not None
    finally:
        proc.core.shutdown()
