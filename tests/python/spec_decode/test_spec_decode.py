"""Speculative decoding with n-gram drafts: outputs equal plain decoding (greedy, seeded,
penalties, logprobs, stops inside an accepted run) under chunked prefill, prefix caching,
preemption and tensor parallelism; the verifier is lossless (chi-square); rollback keeps the
scheduler's invariants; metrics and bad configurations."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from bounded_loops import run_requests
from model_fixtures import save_tiny_model
from vpage import LLM, SamplingParams, _core
from vpage.engine.arg_utils import EngineArgs
from vpage.engine.llm_engine import LLMEngine
from vpage.sampler import Sampler, SamplingRow
from vpage.spec_decode.draft_runner import DraftInputs
from vpage.spec_decode.metrics import SpecDecodeStats
from vpage.spec_decode.verifier import DraftRows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Repetitive prompts give the lookup something to find; the random model repeats itself too.
PROMPTS = [[5, 9, 17, 5, 9], [3] * 20, list(range(10, 40)) + list(range(10, 20)), [7, 8, 7, 8, 7, 8], [42] * 9]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder, seed=3)
    return folder


@pytest.fixture(scope="module")
def other_draft(tiny, tmp_path_factory):
    """A draft of another shape and weights (a qwen2 with one layer), the same tokenizer."""
    folder = tmp_path_factory.mktemp("draft")
    save_tiny_model("qwen2", folder, seed=9, num_hidden_layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, folder / name)
    return folder


def make_engine(folder, spec=None, **kwargs) -> LLMEngine:
    args = dict(model=str(folder), dtype="float32", kv_cache_memory=0.01, block_size=8, speculative_config=spec)
    args.update(kwargs)
    return LLMEngine(EngineArgs(**args))


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    """Each request's final output, checking the scheduler's invariants after every step."""
    outputs = run_requests(engine, requests)
    usage = engine.scheduler.usage()
    assert usage.free_gpu_blocks == usage.num_gpu_blocks  # rejected drafts' blocks all came back
    return outputs


def compare(folder, requests, spec=NGRAM, **kwargs):
    """(plain outputs, speculative outputs, speculative engine's stats)."""
    plain = run(make_engine(folder, **kwargs), requests)
    engine = make_engine(folder, spec, **kwargs)
    try:
        fast = run(engine, requests)
        return plain, fast, engine.get_stats()
    finally:
        engine.shutdown()


def tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def greedy(max_tokens: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("variant", [
    {},
    {"max_num_batched_tokens": 7},  # chunked prompts beside draft rows
    {"enable_prefix_caching": False},
    {"kv_cache_memory": 14 * 8 * 1024 / 2**30, "preemption_mode": "recompute", "max_model_len": 96},
    {"kv_cache_memory": 14 * 8 * 1024 / 2**30, "preemption_mode": "swap", "max_model_len": 96},
], ids=["default", "chunked", "no-prefix-cache", "recompute", "swap"])
def test_greedy_equals_plain_decoding(tiny, variant):
    requests = [(p, greedy()) for p in PROMPTS + PROMPTS[:2]]  # repeated prompts hit the prefix cache
    plain, fast, stats = compare(tiny, requests, **variant)
    assert tokens(fast) == tokens(plain)
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    if "preemption_mode" in variant:
        assert stats.num_preempted_recompute + stats.num_preempted_swap > 0


def test_seeded_sampling_penalties_and_n_equal_plain_decoding(tiny):
    requests = [
        (PROMPTS[0], SamplingParams(temperature=0.9, seed=11, max_tokens=20, ignore_eos=True)),
        (PROMPTS[1], SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, n=3, max_tokens=16,
                                    ignore_eos=True)),
        (PROMPTS[2], greedy(repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1)),
        (PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8)),  # EOS banned at first
    ]
    plain, fast, stats = compare(tiny, requests)
    assert tokens(fast) == tokens(plain)
    assert stats.spec_decode_num_draft_tokens > 0


def test_logprobs_and_stops_inside_accepted_runs(tiny):
    probe = run(make_engine(tiny), [(p, greedy()) for p in PROMPTS])
    requests = []
    for prompt, out in zip(PROMPTS, probe):
        ids = out.outputs[0].token_ids
        requests.append((prompt, greedy(logprobs=2)))
        requests.append((prompt, greedy(stop_token_ids=[ids[9]])))  # a stop token mid-output
        requests.append((prompt, greedy(max_tokens=7)))
    plain, fast, stats = compare(tiny, requests)
    assert stats.spec_decode_num_accepted_tokens > 0
    for a, b in zip(plain, fast):
        x, y = a.outputs[0], b.outputs[0]
        assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (x.token_ids, x.text, x.finish_reason,
                                                                         x.stop_reason)
        if x.logprobs is not None:
            for p, q in zip(x.logprobs, y.logprobs):
                assert p.keys() == q.keys()
                assert [v.logprob for v in p.values()] == pytest.approx([v.logprob for v in q.values()], abs=1e-5)


def test_stop_strings_inside_accepted_runs(tiny):
    probe = run(make_engine(tiny), [(p, greedy()) for p in PROMPTS])
    requests = [(p, greedy(stop=[out.outputs[0].text[6:9]])) for p, out in zip(PROMPTS, probe)
                if len(out.outputs[0].text) > 12]
    assert requests
    plain, fast, _ = compare(tiny, requests)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in fast] == \
           [(o.outputs[0].text, o.outputs[0].finish_reason) for o in plain]


def test_tensor_parallel(tiny):
    requests = [(p, greedy(16)) for p in PROMPTS]
    plain, fast, stats = compare(tiny, requests, tensor_parallel_size=2, num_threads=2)
    assert tokens(fast) == tokens(plain)
    assert stats.spec_decode_num_accepted_tokens > 0


def test_draft_model_under_tensor_parallelism(tiny, other_draft):
    """The draft runs whole on the driver while the target's shards verify on both ranks."""
    requests = [(p, greedy(16)) for p in PROMPTS]
    plain, fast, stats = compare(tiny, requests, {"model": str(tiny), "num_speculative_tokens": 3},
                                 tensor_parallel_size=2, num_threads=2)
    assert tokens(fast) == tokens(plain)
    assert stats.spec_decode_num_accepted_tokens > 0.95 * stats.spec_decode_num_draft_tokens
    _, fast, stats = compare(tiny, requests, {"model": str(other_draft), "num_speculative_tokens": 2},
                             tensor_parallel_size=2, num_threads=2)
    assert tokens(fast) == tokens(plain) and stats.spec_decode_num_draft_tokens > 0


def test_switches_off_above_the_batch_size_and_for_beams(tiny):
    spec = {**NGRAM, "disable_by_batch_size": 2}
    _, fast, stats = compare(tiny, [(p, greedy()) for p in PROMPTS], spec)
    # Five requests run together until the last three finish: the first steps had no drafts.
    assert stats.spec_decode_num_drafts < sum(len(o.outputs[0].token_ids) for o in fast)
    beams = [(PROMPTS[1], SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=8, ignore_eos=True))]
    plain, fast, stats = compare(tiny, beams)
    assert tokens(fast) == tokens(plain) and stats.spec_decode_num_drafts == 0


class _TimedScheduler(_core.Scheduler):
    """The engine's scheduler, recording the (sequences, drafts) of each step it is told the time
    of, and telling it a cost of 5 ms + ``per_row`` per row instead of the measured one."""

    def __init__(self, config, blocks, per_row: float):
        super().__init__(config, blocks)
        self.per_row, self.steps, self.plan = per_row, [], None

    def schedule(self):
        self.plan = super().schedule()
        return self.plan

    def observe_step_time(self, seconds: float) -> None:
        assert seconds > 0
        plan = self.plan
        if plan.num_prefill_tokens == 0:
            self.steps.append((len(plan.sample_seq_ids), plan.num_draft_tokens))
        super().observe_step_time(0.005 + self.per_row * plan.num_tokens)


@pytest.mark.parametrize("per_row, drafts_pay", [(0.005, False), (0.00001, True)])
def test_drafts_follow_the_cost_of_a_row(tiny, other_draft, per_row, drafts_pay):
    """Another model's drafts, sampled at temperature 1, are seldom kept: they stop where a row
    costs half a step and go on where rows are nearly free; the output is unchanged."""
    requests = [([3] * 20, SamplingParams(temperature=1.0, seed=5, max_tokens=48, ignore_eos=True))]
    plain = run(make_engine(tiny), requests)
    engine = make_engine(tiny, {"model": str(other_draft), "num_speculative_tokens": 3})
    timed = _TimedScheduler(engine.scheduler.config, engine.scheduler.block_config, per_row)
    engine.core.scheduler = timed
    fast = run(engine, requests)
    assert tokens(fast) == tokens(plain)
    late = timed.steps[16:-1]  # after the first misses and a fit; the last has no room for drafts
    assert len(late) >= 20
    drafting = sum(1 for _, d in late if d > 0)
    if drafts_pay:
        assert drafting == len(late)
    else:
        assert drafting <= len(late) // 3 and all(d <= 1 for _, d in late)


def test_default_model_copies_with_drafts():
    code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    prompt = f"Repeat this code exactly:\n{code}\nHere it is again:\n"
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain = LLM().generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                  "prompt_lookup_min": 2})
    fast = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert fast.token_ids == plain.token_ids and fast.text == plain.text
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    # The model as its own draft (its GGUF file twice): greedy drafts are the greedy tokens.
    llm = LLM(speculative_config={"model": "smollm2", "num_speculative_tokens": 3})
    fast = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert fast.token_ids == plain.token_ids
    stats = llm.engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0.9 * stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("variant", [
    {},
    {"max_num_batched_tokens": 7},
    {"kv_cache_memory": 14 * 8 * 1024 / 2**30, "preemption_mode": "recompute", "max_model_len": 96},
    {"kv_cache_memory": 14 * 8 * 1024 / 2**30, "preemption_mode": "swap", "max_model_len": 96},
], ids=["default", "chunked", "recompute", "swap"])
def test_draft_model_equals_plain_decoding(tiny, other_draft, variant):
    requests = [(p, greedy()) for p in PROMPTS + PROMPTS[:2]]
    # The target as its own draft: its greedy drafts are the greedy tokens (runs of k + 1 tokens).
    plain, fast, stats = compare(tiny, requests, {"model": str(tiny), "num_speculative_tokens": 3}, **variant)
    assert tokens(fast) == tokens(plain)
    assert stats.spec_decode_num_accepted_tokens > 0.95 * stats.spec_decode_num_draft_tokens
    requests.append((PROMPTS[2], SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)))
    plain = run(make_engine(tiny, **variant), requests)
    # Another model drafts: most drafts are rejected, the output stays the target's.
    _, fast, stats = compare(tiny, requests, {"model": str(other_draft), "num_speculative_tokens": 2}, **variant)
    assert tokens(fast) == tokens(plain)
    assert stats.spec_decode_num_draft_tokens > 0


def test_a_draft_of_the_targets_shape_reads_the_targets_kv_cache(tiny, other_draft):
    # The target as its own draft shares the target's KV cache (no cache of its own, no prompt to
    # catch up on): its drafts are the target's greedy tokens, every one accepted.
    requests = [(p, greedy()) for p in PROMPTS]
    engine = make_engine(tiny, {"model": str(tiny), "num_speculative_tokens": 3})
    try:
        worker = engine.executor.driver_worker
        assert worker.draft_shares_kv and worker.draft_cache is None
        assert tokens(run(engine, requests)) == tokens(run(make_engine(tiny), requests))
        stats = engine.get_stats()
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    finally:
        engine.shutdown()
    # Not when the draft has another shape, or the target's cache another dtype than the draft's.
    for spec, kwargs in (({"model": str(other_draft), "num_speculative_tokens": 2}, {}),
                         ({"model": str(tiny), "num_speculative_tokens": 2}, {"kv_cache_dtype": "float16"})):
        engine = make_engine(tiny, spec, **kwargs)
        try:
            worker = engine.executor.driver_worker
            assert not worker.draft_shares_kv and worker.draft_cache is not None
        finally:
            engine.shutdown()


def test_draft_inputs_cut_to_the_rows_own_positions():
    # Two samples: one catching up on positions 0-5 of a row that starts at 5, one on 7-8 of a
    # row that starts at 7.
    inputs = DraftInputs(input_ids=np.arange(100, 108), positions=np.array([0, 1, 2, 3, 4, 5, 7, 8]),
                         slot_mapping=np.arange(200, 208), query_start_loc=np.array([0, 6, 8], dtype=np.int32),
                         block_tables=np.zeros((2, 2), dtype=np.int32), num_drafts=np.array([3, 1], dtype=np.int32),
                         row_starts=np.array([5, 7]))
    cut = inputs.from_row_starts()
    assert cut.input_ids.tolist() == [105, 106, 107] and cut.positions.tolist() == [5, 7, 8]
    assert cut.slot_mapping.tolist() == [205, 206, 207] and cut.query_start_loc.tolist() == [0, 1, 3]
    assert cut.last_position.tolist() == [5, 8] and cut.num_drafts.tolist() == [3, 1]


def test_draft_model_with_another_vocabulary_is_refused(tiny, tmp_path):
    save_tiny_model("llama", tmp_path, seed=1, vocab_size=400)
    with pytest.raises(ValueError, match="vocabulary has 400 tokens"):
        make_engine(tiny, {"model": str(tmp_path), "num_speculative_tokens": 2})


class _Plan:
    """The fields of a SchedulePlan that DraftRows reads: every sample verifies one draft."""

    def __init__(self, num_samples: int, draft: int):
        self.sample_num_drafts = np.ones(num_samples, dtype=np.int32)
        self.sample_token_indices = np.arange(1, 2 * num_samples, 2, dtype=np.int64)
        self.input_ids = np.tile(np.array([0, draft], dtype=np.int64), num_samples)
        self.num_draft_tokens = num_samples


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_verifier_keeps_the_target_distribution():
    # Position 0 (the draft's) and position 1 have fixed distributions p0, p1 over 6 tokens; the
    # draft proposes token 2. Kept tokens must follow p0 at position 0 whatever the draft, and
    # p1 at position 1 after an accepted draft; a draft is accepted with probability p0[2].
    torch.manual_seed(0)
    n, draft = 6000, 2
    p0 = torch.tensor([0.05, 0.15, 0.4, 0.1, 0.2, 0.1])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.25, 0.05, 0.2])
    plan = _Plan(n, draft)
    rows = DraftRows(plan)
    params = SamplingParams(temperature=1.0)
    sampling = [SamplingRow(params, [1], []) for _ in range(n)]
    verified = rows.verify(Sampler(), p1.log().repeat(n, 1), p0.log().repeat(n, 1), sampling, None)
    stats = SpecDecodeStats()
    stats.add_step(verified.num_drafts, verified.num_accepted)
    kept = verified.sampled.token_ids.tolist()
    first = np.array([kept[start] for start, _ in verified.runs])
    accepted = np.array([count == 2 for _, count in verified.runs])
    assert (first[accepted] == draft).all() and (first[~accepted] != draft).all()
    # 5 degrees of freedom: 20.5 is the 0.001 critical value.
    assert _chi_square(np.bincount(first, minlength=6), p0.numpy()) < 20.5
    second = np.array([kept[start + 1] for start, count in verified.runs if count == 2])
    assert _chi_square(np.bincount(second, minlength=6), p1.numpy()) < 20.5
    assert stats.num_accepted_tokens == accepted.sum() and stats.num_draft_tokens == n
    assert abs(accepted.mean() - 0.4) < 4 * (0.4 * 0.6 / n) ** 0.5


def _chi_square_critical(df: int, z: float = 3.090) -> float:
    """The chi-square value exceeded with probability 0.001 (z: the normal's 0.999 quantile), by
    Wilson and Hilferty's cube-root approximation (within 1% from 5 degrees of freedom on)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * h ** 0.5) ** 3


def test_unseeded_sampling_through_the_engine_keeps_the_distribution(tiny):
    # The same sampled request many times, unseeded (engine seeds make the runs repeatable),
    # with and without n-gram drafts: the generated tokens must follow one distribution (a
    # chi-square test of homogeneity over the outputs, rare ones pooled), while drafts were both
    # accepted and rejected, so both branches of the verifier ran. The prompt quotes the model's
    # own greedy continuation of its end, so the lookup's drafts are often likely tokens.
    start = PROMPTS[0]
    continuation = run(make_engine(tiny), [(start, greedy(12))])[0].outputs[0].token_ids
    prompt = start + list(continuation) + start
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
    requests = [(prompt, params)] * 1500
    plain = run(make_engine(tiny, seed=7, max_num_seqs=256), requests)
    engine = make_engine(tiny, NGRAM, seed=8, max_num_seqs=256)  # independent draws, not coupled ones
    fast, stats = run(engine, requests), engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    a = [tuple(o.outputs[0].token_ids) for o in plain]
    b = [tuple(o.outputs[0].token_ids) for o in fast]
    categories = sorted(set(a) | set(b))
    counts = np.array([[a.count(c) for c in categories], [b.count(c) for c in categories]], dtype=np.float64)
    rare = counts.sum(axis=0) < 20
    table = np.concatenate([counts[:, ~rare], counts[:, rare].sum(axis=1, keepdims=True)], axis=1)
    table = table[:, table.sum(axis=0) > 0]
    pooled = table.sum(axis=0) / table.sum()  # each row against the two runs' common distribution
    statistic = _chi_square(table[0], pooled) + _chi_square(table[1], pooled)
    assert table.shape[1] >= 4, f"too few distinct outputs to test: {table.shape[1]}"
    assert statistic < _chi_square_critical(table.shape[1] - 1)


@pytest.mark.parametrize("spec,message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min \\(4\\) > prompt_lookup_max \\(2\\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys \\['lookahead'\\]"),
    ("{not json", "not valid JSON"),
])
def test_bad_configurations_are_clear_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=spec)


def test_prompt_lookup_defaults_follow_vllm():
    args = EngineArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    spec = args.create_engine_config().speculative
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens) == (3, 3, 2)


def test_server_exports_vllm_metric_names_and_the_bench_client_reads_them(tiny):
    from vpage.benchmarks.serve import _acceptance, format_report, parse_spec_decode_counters
    from vpage.engine.core_messages import StepOutputs
    from vpage.entrypoints.openai.server_metrics import ServerMetrics

    engine = make_engine(tiny, NGRAM)
    try:
        run(engine, [(p, greedy()) for p in PROMPTS])
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    metrics = ServerMetrics("tiny")
    before = parse_spec_decode_counters(metrics.render().decode())
    metrics.on_step(StepOutputs(stats=stats), [], 0.0)
    text = metrics.render().decode()
    for pos, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
        assert f'vpage:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="tiny",position="{pos}"}} ' \
               f'{float(count)}' in text
    after = parse_spec_decode_counters(text)
    assert after == {"spec_decode_num_drafts": stats.spec_decode_num_drafts,
                     "spec_decode_num_draft_tokens": stats.spec_decode_num_draft_tokens,
                     "spec_decode_num_accepted_tokens": stats.spec_decode_num_accepted_tokens}
    spec = _acceptance(before, after)
    assert spec["acceptance_rate"] == stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
    report = {"completed": 1, "failed": 0, "duration_s": 1.0, "request_throughput": 1.0, "output_throughput": 1.0,
              "goodput": 1.0, "spec_decode": spec, **{k: {"mean": None} for k in ("ttft_ms", "tpot_ms", "itl_ms",
                                                                                 "e2e_ms")}}
    assert "draft tokens accepted" in format_report(report)
