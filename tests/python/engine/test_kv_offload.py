"""The KV cache's lower tiers end to end, on a tiny random Llama saved to disk.

A KV cache of a few blocks evicts every prefix between two turns of one conversation. With
``kv_offloading_size`` the evicted blocks come back from host memory, with
``kv_offloading_disk_path`` from files, also in a new engine over the same folder; outputs equal
a run that computes everything, cache salts never share, and a corrupt or truncated file is
recomputed. Block invariants are checked after every step.
"""

from __future__ import annotations

import os

import pytest

from bounded_loops import bounded
from model_fixtures import save_tiny_model
from vpage import EngineArgs, LLMEngine, SamplingParams

BS = 8
BLOCK_BYTES = 2 * 2 * 2 * 16 * BS * 4  # layers x (K, V) x kv heads x head size x block size x float32
GiB = 2**30

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path, seed=5)
    return path


def make_engine(folder, **kwargs) -> LLMEngine:
    # 24 KV blocks: one 100-token prompt (13 blocks) at a time; the next prompt evicts it.
    args = dict(model=str(folder), dtype="float32", kv_cache_memory=24 * BLOCK_BYTES / GiB, block_size=BS,
                num_threads=1, swap_space=0.0, max_model_len=128)
    args.update(kwargs)
    return LLMEngine(EngineArgs(**args))


def prompt(i: int, n: int = 100) -> list[int]:
    return [(37 * i + 11 * k + 5) % 250 + 3 for k in range(n)]


def run(engine: LLMEngine, request_id: str, tokens: list[int], salt: str | None = None) -> tuple[list[int], int]:
    """Greedy tokens of one request run alone, and its prompt tokens served from a cache."""
    engine.add_request(request_id, {"prompt_token_ids": tokens},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), cache_salt=salt)
    final = None
    for _ in bounded(engine.has_unfinished_requests, 1000, "request unfinished"):
        for out in engine.step():
            engine.scheduler.check_invariants()
            if out.finished:
                final = out
    return list(final.outputs[0].token_ids), final.num_cached_tokens


def conversation(engine: LLMEngine, others: int = 2, salt_again: str | None = None) -> list[tuple[list[int], int]]:
    """Prompt 0, then prompts 1 .. ``others`` (which evict it), then prompt 0 again."""
    order = (0, *range(1, others + 1), 0)
    return [run(engine, f"r{i}", prompt(p), salt_again if i == others + 1 else None) for i, p in enumerate(order)]


@pytest.fixture(scope="module")
def cold(folder):
    """Prompts 0 to 4 computed from scratch."""
    engine = make_engine(folder, enable_prefix_caching=False)
    return [run(engine, f"c{i}", prompt(i))[0] for i in range(5)]


def expected(cold, others: int = 2) -> list[list[int]]:
    return [cold[0], *cold[1:others + 1], cold[0]]


def test_without_tiers_the_evicted_prefix_is_recomputed(folder, cold):
    results = conversation(make_engine(folder))
    assert [tokens for tokens, _ in results] == expected(cold)
    assert results[3][1] == 0


def test_cpu_tier_serves_the_evicted_prefix(folder, cold):
    engine = make_engine(folder, kv_offloading_size=64 * BLOCK_BYTES / GiB)
    results = conversation(engine)
    assert [tokens for tokens, _ in results] == expected(cold)
    assert results[3][1] == 96  # every full block of 100 tokens but the one holding the last token
    usage = engine.scheduler.usage()
    assert usage.cpu_prefix_cache.hits == 12 and usage.num_disk_blocks == 0
    stats = engine.get_stats()  # vLLM's external_prefix_cache_* metrics
    assert stats.external_prefix_cache_hits == 12 and stats.external_prefix_cache_queries >= 12


def test_cpu_tier_keeps_tenants_apart(folder, cold):
    results = conversation(make_engine(folder, kv_offloading_size=64 * BLOCK_BYTES / GiB), salt_again="tenant-b")
    assert [tokens for tokens, _ in results] == expected(cold)
    assert results[3][1] == 0


def disk_engine(folder, path, **kwargs) -> LLMEngine:
    # A CPU tier of 16 blocks (a step evicts up to 14): the prompts reach the disk.
    return make_engine(folder, kv_offloading_size=16 * BLOCK_BYTES / GiB, kv_offloading_disk_path=str(path),
                       kv_offloading_disk_size=256 * BLOCK_BYTES / GiB, **kwargs)


def block_files(path) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(path) for name in names if name.endswith(".kv")]


def test_disk_tier_serves_the_prefix_and_outlives_the_engine(folder, cold, tmp_path):
    engine = disk_engine(folder, tmp_path)
    results = conversation(engine, others=4)  # 52 blocks: prompt 0 leaves the CPU tier too
    assert [tokens for tokens, _ in results] == expected(cold, 4)
    assert results[5][1] == 96
    assert engine.scheduler.usage().disk_prefix_cache.hits == 12
    engine.shutdown()  # its last files written
    files = block_files(tmp_path)
    assert len(files) == engine.scheduler.usage().used_disk_blocks >= 12

    # A new engine over the same folder finds prompt 0's blocks in the files (but not for another tenant).
    restarted = disk_engine(folder, tmp_path)
    assert restarted.scheduler.usage().used_disk_blocks == len(files)
    assert run(restarted, "salted", prompt(0), salt="tenant-b") == (cold[0], 0)
    assert run(restarted, "again", prompt(0)) == (cold[0], 96)


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_damaged_files_are_recomputed(folder, cold, tmp_path, damage):
    engine = disk_engine(folder, tmp_path)
    conversation(engine, others=4)
    engine.shutdown()  # its last files written
    # A restarted engine indexes the files; then every one is damaged, and every load fails its check.
    restarted = disk_engine(folder, tmp_path)
    for path in block_files(tmp_path):
        if damage == "delete":
            os.remove(path)
            continue
        with open(path, "r+b") as f:
            size = os.path.getsize(path)
            if damage == "truncate":
                f.truncate(size - 7)
            else:
                f.seek(size - 3)
                f.write(bytes(3 * [0x5A]))
    files = len(block_files(tmp_path))
    assert run(restarted, "again", prompt(0)) == (cold[0], 0)
    assert restarted.scheduler.usage().disk_prefix_cache.hits == 12  # found, then failed to load
    assert run(restarted, "twice", prompt(0)) == (cold[0], 96)  # computed again, cached on the device
    restarted.shutdown()
    assert len(block_files(tmp_path)) == max(files - 12, 0)  # the failed files are gone


def test_offloading_arguments_are_checked(folder, tmp_path):
    with pytest.raises(ValueError, match="kv_offloading_size must be > 0"):
        EngineArgs(kv_offloading_size=0)
    with pytest.raises(ValueError, match="'native'"):
        EngineArgs(kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="needs kv_offloading_size"):
        EngineArgs(kv_offloading_disk_path=str(tmp_path))
    with pytest.raises(ValueError, match="prefix caching"):
        EngineArgs(kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="runs on one rank only"):
        EngineArgs(kv_offloading_size=1, kv_offloading_disk_path=str(tmp_path), tensor_parallel_size=2)
