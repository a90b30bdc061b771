"""Memory sharing and preemption end to end, on a tiny random Llama saved to disk.

Parallel samples share their prompt's blocks (the prompt is computed once); the prefix
cache serves shared prefixes without recomputing them, never across cache salts, and stays
correct while it evicts; chunked prefill keeps every step within the token budget and never
stalls running decodes; recompute and swap preemption under a small KV pool give the same
outputs as an unconstrained run and leave every block free. The block invariants are
checked after every step.
"""

from __future__ import annotations

import math

import pytest

from bounded_loops import bounded
from model_fixtures import save_tiny_model
from vpage import EngineArgs, LLMEngine, SamplingParams, _core

BS = 8
BLOCK_BYTES = 2 * 2 * 2 * 16 * BS * 4  # layers x (K, V) x kv heads x head size x block size x float32
GiB = 2**30


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path, seed=3)
    return path


def make_engine(folder, **kwargs) -> LLMEngine:
    args = dict(model=str(folder), dtype="float32", kv_cache_memory=0.01, block_size=BS, num_threads=1)
    args.update(kwargs)
    return LLMEngine(EngineArgs(**args))


def pool(num_blocks: int) -> float:
    """kv_cache_memory / swap_space (GiB) holding exactly ``num_blocks`` blocks of the tiny model."""
    return num_blocks * BLOCK_BYTES / GiB


def used_blocks(engine: LLMEngine) -> int:
    usage = engine.scheduler.usage()
    return usage.num_gpu_blocks - usage.free_gpu_blocks


def greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def drain(engine: LLMEngine, on_step=None) -> tuple[dict, list[int]]:
    """Steps until nothing is left; returns the final outputs by request id and the used
    block count after each step. Invariants are checked after every step."""
    finished, used = {}, []
    for _ in bounded(engine.has_unfinished_requests, 10_000, "requests still unfinished"):
        outs = engine.step()
        engine.scheduler.check_invariants()
        used.append(used_blocks(engine))
        if on_step is not None:
            on_step(outs)
        for out in outs:
            if out.finished:
                finished[out.request_id] = out
    return finished, used


def assert_all_free(engine: LLMEngine) -> None:
    usage = engine.scheduler.usage()
    assert usage.free_gpu_blocks == usage.num_gpu_blocks
    assert usage.free_cpu_blocks == usage.num_cpu_blocks
    assert engine.scheduler.num_kv_tokens() == 0
    assert not engine.scheduler.has_unfinished()


def token_ids(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


class PlanRecorder:
    """A thin proxy for the engine's scheduler that records every plan's token counts."""

    def __init__(self, scheduler):
        self._scheduler = scheduler
        self.plans: list[tuple[int, int, int]] = []  # (num_tokens, num_prefill_tokens, num_decode_tokens)

    def schedule(self):
        plan = self._scheduler.schedule()
        self.plans.append((plan.num_tokens, plan.num_prefill_tokens, plan.num_decode_tokens))
        return plan

    def __getattr__(self, name):
        return getattr(self._scheduler, name)


# ------------------------------------------------------------------ parallel sampling

PROMPT = list(range(10, 53))  # 43 tokens: 5 full blocks and a partly filled one


def _sampled(seed: int, n: int = 4, max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.8, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def test_parallel_sampling_computes_the_prompt_once_and_shares_its_blocks(folder):
    n, max_tokens = 4, 20
    engine = make_engine(folder, enable_prefix_caching=False)
    engine.add_request("par", PROMPT, _sampled(7, n, max_tokens))
    outs, used = drain(engine)
    stats = engine.scheduler.stats
    assert stats.num_prefill_tokens == len(PROMPT)  # computed once, not n times
    assert stats.num_decode_tokens == n * (max_tokens - 1)
    samples = token_ids(outs["par"])
    assert len(samples) == n and all(len(s) == max_tokens for s in samples)
    assert len({tuple(s) for s in samples}) == n  # the samples diverged
    assert_all_free(engine)

    indep = make_engine(folder, enable_prefix_caching=False)
    for i in range(n):
        indep.add_request(f"r{i}", PROMPT, _sampled(7 + i, 1, max_tokens))
    _, used_indep = drain(indep)
    assert indep.scheduler.stats.num_prefill_tokens == n * len(PROMPT)
    assert_all_free(indep)

    total_blocks = math.ceil((len(PROMPT) + max_tokens - 1) / BS)  # the last token is not stored
    shared = len(PROMPT) // BS  # full prompt blocks stay shared; the partial one is copied on write
    assert max(used) == shared + n * (total_blocks - shared) < max(used_indep) == n * total_blocks
    assert sum(used) / len(used) < sum(used_indep) / len(used_indep)


def test_parallel_sampling_is_reproducible_with_seeds(folder):
    def run(with_neighbours: bool) -> list[list[int]]:
        engine = make_engine(folder)
        engine.add_request("par", PROMPT, _sampled(11))
        if with_neighbours:  # other requests in the batch do not change a seeded request
            engine.add_request("x", list(range(60, 90)), SamplingParams(temperature=1.0, max_tokens=12))
            engine.add_request("y", PROMPT[:20], SamplingParams(n=2, temperature=0.7, seed=3, max_tokens=25))
        outs, _ = drain(engine)
        assert_all_free(engine)
        return token_ids(outs["par"])

    first = run(False)
    assert run(False) == first
    assert run(True) == first


# ---------------------------------------------------------------------- prefix caching

SHARED = list(range(20, 116))  # 96 tokens = 12 full blocks
TAILS = [[200 + i, 210 + i, 220 + i, 230 + i, 240 + i] for i in range(4)]


def test_prefix_caching_does_not_change_greedy_outputs(folder):
    prompts = [SHARED + t for t in TAILS] + [SHARED[:50], SHARED[:50] + [7]]

    def run(caching: bool) -> list[list[int]]:
        engine = make_engine(folder, enable_prefix_caching=caching)
        results = []
        for wave in (prompts[:2], prompts[2:]):  # the second wave can hit the first one's blocks
            for i, p in enumerate(wave):
                engine.add_request(f"{len(results)}-{i}", p, greedy(12))
            outs, _ = drain(engine)
            results += [outs[f"{len(results)}-{i}"].outputs[0].token_ids for i in range(len(wave))]
        assert_all_free(engine)
        hits = engine.scheduler.usage().prefix_cache.hits
        assert (hits > 0) == caching
        return results

    assert run(True) == run(False)


def test_second_request_with_a_shared_prefix_computes_only_its_tail(folder):
    engine = make_engine(folder)
    engine.add_request("first", SHARED + TAILS[0], greedy(4))
    outs, _ = drain(engine)
    assert outs["first"].num_cached_tokens == 0
    before = engine.scheduler.stats.num_prefill_tokens
    engine.add_request("second", SHARED + TAILS[1], greedy(4))
    outs, _ = drain(engine)
    assert outs["second"].num_cached_tokens == len(SHARED)
    assert engine.scheduler.stats.num_prefill_tokens - before == len(TAILS[1])
    assert_all_free(engine)


def test_cache_salts_isolate_prefixes(folder):
    engine = make_engine(folder)

    def cached(rid: str, tail: list[int], salt) -> int:
        engine.add_request(rid, SHARED + tail, greedy(2), cache_salt=salt)
        outs, _ = drain(engine)
        return outs[rid].num_cached_tokens

    assert cached("a1", TAILS[0], "a") == 0
    assert cached("b1", TAILS[1], "b") == 0  # same tokens, another salt: no hit
    assert cached("none", TAILS[2], None) == 0  # no salt is a salt of its own
    assert cached("a2", TAILS[3], "a") == len(SHARED)
    assert cached("b2", TAILS[0], "b") == len(SHARED)
    assert_all_free(engine)


def colliding(engine: LLMEngine) -> LLMEngine:
    """The engine with a fresh scheduler whose block hashes all collide (the test hook)."""
    blocks = engine.scheduler.block_config
    blocks.collide_prefix_hashes_for_testing = True
    engine.core.scheduler = _core.Scheduler(engine.scheduler.config, blocks)
    return engine


def test_forced_hash_collisions_never_share_wrong_blocks(folder):
    # Distinct prompts (some with a common first block, most not), in two waves so the second
    # looks the first one's blocks up: every lookup meets the one colliding index entry.
    prompts = [[(13 * k + 5 * j) % 300 + 10 for j in range(40)] for k in range(6)]
    prompts += [prompts[0][:8] + [250 + k] * 20 for k in range(2)]

    def run(engine: LLMEngine, salt=None) -> list[list[int]]:
        results = []
        for wave in (prompts[:4], prompts[4:]):
            for i, p in enumerate(wave):
                engine.add_request(f"{len(results)}-{i}", p, greedy(10), cache_salt=salt)
            outs, _ = drain(engine)
            results += [outs[f"{len(results)}-{i}"].outputs[0].token_ids for i in range(len(wave))]
        assert_all_free(engine)
        return results

    reference = run(make_engine(folder, enable_prefix_caching=False))
    engine = colliding(make_engine(folder))
    assert run(engine) == reference
    cache = engine.scheduler.usage().prefix_cache
    # Only exact hits: the index's one entry is prompts[0]'s first block, which the two
    # prompts built on it find; every other first lookup collides and misses (a chain's later
    # blocks then miss without a lookup).
    assert cache.hits == 2 and cache.queries - cache.hits >= cache.collisions > 0
    # Under another salt the same prompts hit nothing: the one index entry holds prompts[0]'s
    # first block, same tokens and hash, but no salt.
    hits = cache.hits
    assert run(engine, salt="tenant-2") == reference
    assert engine.scheduler.usage().prefix_cache.hits == hits


def test_prefix_cache_eviction_under_a_tiny_pool_stays_correct(folder):
    # 6 distinct 72-token prefixes through a pool of 14 blocks (one request needs 10), one
    # request at a time: each new prefix evicts the tail of the cached chains, so a repeated
    # prefix hits only the blocks that survived (or nothing).
    prefixes = [[(31 * k + 7 * j) % 300 + 10 for j in range(72)] for k in range(6)]
    order = [0, 0, 1, 0, 2, 3, 1, 4, 0, 5, 5, 2, 3]
    prompts = [prefixes[k] + [250 + i] for i, k in enumerate(order)]

    def run(**kwargs) -> tuple[list[list[int]], LLMEngine]:
        engine = make_engine(folder, max_model_len=88, **kwargs)
        results = []
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(6))
            outs, _ = drain(engine)
            results.append(outs[str(i)].outputs[0].token_ids)
        assert_all_free(engine)
        return results, engine

    reference, _ = run(enable_prefix_caching=False)
    tiny, engine = run(kv_cache_memory=pool(14))
    assert tiny == reference
    cache = engine.scheduler.usage().prefix_cache
    assert cache.evictions > 0 and cache.hits > 0


# --------------------------------------------------------------------- chunked prefill

def test_chunked_prefill_matches_unchunked_and_respects_the_budget(folder):
    prompts = [list(range(10, 210)), [5, 9, 17], list(range(40, 140)), [3] * 33]

    def run(**kwargs):
        engine = make_engine(folder, **kwargs)
        recorder = engine.core.scheduler = PlanRecorder(engine.scheduler)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(10))
        outs, _ = drain(engine)
        assert_all_free(engine)
        return [outs[str(i)].outputs[0].token_ids for i in range(len(prompts))], recorder.plans

    unchunked, plans = run(enable_chunked_prefill=False, max_num_batched_tokens=1024, enable_prefix_caching=False)
    assert max(t for t, _, _ in plans) > 200  # the long prompt went in one piece
    for budget in (16, 37):
        chunked, plans = run(max_num_batched_tokens=budget, enable_prefix_caching=False)
        assert chunked == unchunked, budget
        assert max(t for t, _, _ in plans) <= budget
        assert sum(p for _, p, _ in plans) == sum(map(len, prompts))


def test_a_long_prompt_does_not_stall_running_decodes(folder):
    budget = 16
    engine = make_engine(folder, max_num_batched_tokens=budget)
    recorder = engine.core.scheduler = PlanRecorder(engine.scheduler)
    for i in range(3):
        engine.add_request(f"d{i}", [11 + i, 12, 13], greedy(60))
    for _ in range(20):  # until all three decode
        outs = engine.step()
        if len(outs) == 3 and all(len(o.outputs[0].token_ids) >= 1 for o in outs):
            break
    else:
        pytest.fail("the three requests did not all decode within 20 steps")
    long_prompt = list(range(20, 220))
    engine.add_request("long", long_prompt, greedy(4))
    lengths = {o.request_id: len(o.outputs[0].token_ids) for o in outs}
    prefill_steps = 0
    for _ in bounded(lambda: not engine.scheduler.find_group("long").seq(0).num_output_tokens, 1000,
                     "the long prompt has no output token"):
        outs = {o.request_id: o for o in engine.step()}
        engine.scheduler.check_invariants()
        prefill_steps += 1
        for rid in lengths:  # every running decode got exactly one token in this step
            assert len(outs[rid].outputs[0].token_ids) == lengths[rid] + 1, (rid, prefill_steps)
            lengths[rid] += 1
        assert recorder.plans[-1][0] <= budget
    assert prefill_steps >= len(long_prompt) // (budget - 3)  # it really was chunked
    drain(engine)
    assert_all_free(engine)


# -------------------------------------------------------------------------- preemption

PRESSURE = [list(range(10, 40)), [3] * 40, list(range(60, 85)), [7, 8, 9] * 9, list(range(100, 133)), [42] * 19]


def _pressure_run(folder, params=None, **kwargs) -> tuple[list[list[list[int]]], LLMEngine]:
    engine = make_engine(folder, max_model_len=96, **kwargs)
    for i, p in enumerate(PRESSURE):
        engine.add_request(str(i), p, params or greedy(40))
    outs, _ = drain(engine)
    assert_all_free(engine)
    return [token_ids(outs[str(i)]) for i in range(len(PRESSURE))], engine


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches_an_unconstrained_run(folder, mode):
    reference, _ = _pressure_run(folder)
    outputs, engine = _pressure_run(folder, kv_cache_memory=pool(12), preemption_mode=mode)
    assert outputs == reference
    stats = engine.get_stats()
    if mode == "swap":
        assert stats.num_preempted_swap > 0
    else:
        assert stats.num_preempted_recompute > 0 and stats.num_preempted_swap == 0


@pytest.mark.parametrize("mode", ["auto", "swap"])
def test_preempted_parallel_samples_match_an_unconstrained_run(folder, mode):
    # 3 samples of up to 40 + 19 tokens: a group needs at most 14 blocks (shared full prompt
    # blocks + its own), so each fits alone in 16 but not two at once.
    params = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=20, ignore_eos=True)
    reference, _ = _pressure_run(folder, params)
    outputs, engine = _pressure_run(folder, params, kv_cache_memory=pool(16), preemption_mode=mode)
    assert outputs == reference
    assert engine.get_stats().num_preempted_swap > 0


def test_recompute_preempted_parallel_samples_complete(folder):
    params = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=20, ignore_eos=True)
    reference, _ = _pressure_run(folder, params)
    outputs, engine = _pressure_run(folder, params, kv_cache_memory=pool(16), preemption_mode="recompute")
    assert engine.get_stats().num_preempted_recompute > 0
    assert [[len(s) for s in r] for r in outputs] == [[20] * 3] * len(PRESSURE)
    assert outputs == reference


def test_swap_falls_back_to_recompute_without_cpu_room(folder):
    reference, _ = _pressure_run(folder)
    outputs, engine = _pressure_run(folder, kv_cache_memory=pool(12), preemption_mode="swap",
                                    swap_space=pool(1))
    assert engine.scheduler.usage().num_cpu_blocks == 1
    assert outputs == reference
    stats = engine.get_stats()
    assert stats.num_preempted_recompute > 0 and stats.num_preempted_swap == 0  # no group fits in one block


def test_aborting_a_swapped_request_frees_everything(folder):
    engine = make_engine(folder, max_model_len=96, kv_cache_memory=pool(12), preemption_mode="swap")
    for i, p in enumerate(PRESSURE):
        engine.add_request(str(i), p, greedy(40))
    for _ in bounded(lambda: not engine.scheduler.num_swapped, 1000, "nothing swapped out"):
        engine.step()
        engine.scheduler.check_invariants()
    swapped = [r for r in engine.requests
               if engine.scheduler.find_group(r).seq(0).status.name == "SWAPPED"]
    assert swapped
    cpu_used = engine.scheduler.usage().num_cpu_blocks - engine.scheduler.usage().free_cpu_blocks
    assert cpu_used > 0
    engine.abort_request(swapped)
    engine.scheduler.check_invariants()
    assert engine.scheduler.num_swapped == 0
    usage = engine.scheduler.usage()
    assert usage.free_cpu_blocks == usage.num_cpu_blocks
    assert all(engine.scheduler.find_group(r) is None for r in swapped)
    outs, _ = drain(engine)
    assert set(outs) == {str(i) for i in range(len(PRESSURE))} - set(swapped)
    assert_all_free(engine)


# ------------------------------------------------------------------------ statistics

def test_stats_count_a_scripted_trace_exactly(folder):
    # Two 8-token prompts (one block each) generating 16 tokens each in a pool of 5 blocks,
    # recompute mode, no prefix cache. Both grow into their second block at their 9th token;
    # at the 17th (third block) only one block is left: A takes it and B, the latest
    # arrival, is preempted with 9 outputs. When A finishes B comes back as a 17-token prompt.
    engine = make_engine(folder, kv_cache_memory=pool(5), max_model_len=40, enable_prefix_caching=False,
                         preemption_mode="recompute")
    engine.add_request("A", list(range(10, 18)), greedy(16), arrival_time=0.0)
    engine.add_request("B", list(range(20, 28)), greedy(16), arrival_time=1.0)
    outs, _ = drain(engine)
    assert [len(outs[r].outputs[0].token_ids) for r in "AB"] == [16, 16]
    stats = engine.get_stats()
    assert stats.num_preempted_recompute == 1 and stats.num_preempted_swap == 0
    assert stats.prefill_tokens == 8 + 8 + 17  # the prompts, then B's prompt + 9 outputs again
    assert stats.generation_tokens == 32
    assert engine.scheduler.stats.num_decode_tokens == 15 + (8 + 6)  # B: 8 before, 6 after
    assert stats.num_running == stats.num_waiting == stats.num_swapped == 0 and stats.kv_cache_usage == 0.0

    # Prefix cache: a 20-token prompt queries its two full blocks and misses both (the last
    # token's block is never queried); a second one sharing those 16 tokens hits both.
    engine = make_engine(folder)
    engine.add_request("first", list(range(30, 50)), greedy(3))
    drain(engine)
    engine.add_request("second", list(range(30, 46)) + [90, 91, 92, 93], greedy(3))
    outs, _ = drain(engine)
    cache = engine.scheduler.usage().prefix_cache
    assert (cache.queries, cache.hits, cache.collisions) == (4, 2, 0)
    assert outs["second"].num_cached_tokens == 16
    stats = engine.get_stats()
    assert stats.prefix_cache_hit_rate == 2 / 4
    assert stats.prefill_tokens == 20 + 4 and stats.generation_tokens == 6
