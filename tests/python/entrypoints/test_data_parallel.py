"""Data parallelism: the prefix router on its own (KV events in, a replica out), then `vpage serve
--data-parallel-size 2` on a tiny random model, its replicas local processes and Ray actors: the
same greedy text as one engine, repeated prefixes on the replica that caches them, a dead
replica failing only its own requests. Servers with Ray replicas end by themselves (SIGTERM, or
their last replica's death), so that Ray's own processes go with them."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from bounded_loops import bounded
from live_server import LiveServer
from model_fixtures import save_tiny_model
from vpage.distributed.kv_events import offset_endpoint_port
from vpage.engine.arg_utils import EngineArgs
from vpage.engine.dp_router import PrefixRouter, block_keys

pytestmark = pytest.mark.timeout(600)

BS = 4  # block size of the router tests


def loads(*values):
    """Replica index -> load."""
    return dict(enumerate(values))


def stored(hashes, tokens, parent=None, lora_id=None):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "lora_id": lora_id, "medium": "GPU"}


def test_router_follows_each_replicas_events():
    router = PrefixRouter(BS, max_recent_blocks=0)  # only what the events say
    prompt = list(range(1, 14))  # 3 full blocks and a partial one
    assert len(block_keys(prompt, BS)) == 3
    # Replica 2 caches the first two blocks (two events, chained), replica 1 the first one.
    router.on_events(2, [stored([b"a" * 16], prompt[:4]), stored([b"b" * 16], prompt[4:8], parent=b"a" * 16)])
    router.on_events(1, [stored([b"x" * 16], prompt[:4])])
    assert [router.matched_blocks(i, block_keys(prompt, BS)) for i in range(3)] == [0, 1, 2]
    assert router.choose(prompt, loads(0, 0, 0)) == 2
    # Another prompt with the same first block only: replicas 1 and 2 tie, the least loaded wins.
    other = prompt[:4] + [99] * 8
    assert router.choose(other, loads(0, 0, 1)) == 1
    # Too busy: more than `imbalance` requests beyond the least loaded replica.
    assert router.choose(prompt, loads(0, 0, router.imbalance + 1)) == 0
    assert router.choose(prompt, loads(5, 5, 5 + router.imbalance)) == 2
    # Evicted: replica 2 loses its second block, then the first; a dead replica is skipped.
    router.on_events(2, [{"type": "BlockRemoved", "block_hashes": [b"b" * 16], "medium": "GPU"}])
    assert router.matched_blocks(2, block_keys(prompt, BS)) == 1
    router.on_events(2, [{"type": "BlockRemoved", "block_hashes": [b"a" * 16], "medium": "GPU"}])
    assert router.matched_blocks(2, block_keys(prompt, BS)) == 0
    assert router.choose(prompt, loads(3, None, 0)) == 2  # replica 1 holds it but cannot serve
    with pytest.raises(ValueError, match="no engine replica"):
        router.choose(prompt, loads(None, None, None))
    # An adapter's blocks are not the base model's; a cleared cache forgets everything.
    router.on_events(0, [stored([b"l" * 16], prompt[:4], lora_id=7)])
    assert router.matched_blocks(0, block_keys(prompt, BS)) == 0
    assert router.matched_blocks(0, block_keys(prompt, BS, lora_id=7)) == 1
    router.on_events(0, [{"type": "AllBlocksCleared"}])
    assert router.matched_blocks(0, block_keys(prompt, BS, lora_id=7)) == 0


def test_router_spreads_new_prefixes_and_keeps_a_burst_together():
    router = PrefixRouter(BS)
    a, b = list(range(1, 9)), list(range(50, 58))
    first = router.choose(a, loads(0, 0))
    assert router.choose(b, loads(0, 0)) != first  # nothing cached: equal loads take turns
    # A burst sharing a's prefix follows it before any event arrives (recently routed blocks).
    assert all(router.choose(a + [i], loads(0, 0)) == first for i in range(5))
    # Replicas are any keys (Ray Serve's replica ids); one that left is forgotten.
    assert router.choose(a, {"x": 0, "y": 0}) in ("x", "y")
    router.forget("x")
    assert "x" not in router.replicas


def test_offset_endpoint_port_and_argument_checks():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint_port(None, 3) is None
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        EngineArgs(data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_rank must lie in"):
        EngineArgs(data_parallel_size=2, data_parallel_rank=2)
    with pytest.raises(ValueError, match="not runner 'pooling'"):
        EngineArgs(data_parallel_size=2, runner="pooling")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-dp")
    save_tiny_model("llama", folder, max_position_embeddings=4096)
    return str(folder)


BACKENDS = ["mp", "ray"]


def dp_server(model: str, backend: str, *extra: str) -> LiveServer:
    return LiveServer("--model", model, "--dtype", "float32", "--kv-cache-memory", "0.02", "--max-num-seqs", "4",
                      "--data-parallel-size", "2", "--data-parallel-backend", backend, *extra,
                      env={"VLLM_SERVER_DEV_MODE": "1"})


def per_engine(srv: LiveServer, name: str) -> list[float]:
    status, body = srv.request("GET", "/metrics")
    lines = body["raw"].splitlines()
    return [sum(float(line.rsplit(" ", 1)[1]) for line in lines
                if line.startswith(f"vpage:{name}{{") and f'engine="{i}"' in line) for i in range(2)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_replicas_give_one_engines_text_and_route_by_prefix(tiny_model, backend):
    from vpage import LLM, SamplingParams

    prompts = [list(range(3 + 7 * i, 70 + 7 * i)) for i in range(4)]  # 67 tokens: 4 full blocks each
    llm = LLM(tiny_model, dtype="float32", kv_cache_memory=0.02)
    want = [out.outputs[0].text for out in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    del llm
    srv = dp_server(tiny_model, backend)
    try:
        assert len(srv.core_pids) == 2
        body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
        for prompt, text in zip(prompts, want):
            status, answer = srv.request("POST", "/v1/completions", {**body, "prompt": prompt})
            assert status == 200 and answer["choices"][0]["text"] == text
        queries = per_engine(srv, "prefix_cache_queries_total")
        assert all(q > 0 for q in queries)  # new prefixes were spread over both replicas
        # Each prompt again, with a new tail: it goes where its prefix is cached (a hit every time).
        hits_before = sum(per_engine(srv, "prefix_cache_hits_total"))
        for prompt in prompts:
            status, answer = srv.request("POST", "/v1/completions", {**body, "prompt": prompt + [1, 2, 3]})
            assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        assert sum(per_engine(srv, "prefix_cache_hits_total")) - hits_before == 4 * 4
        # Dev mode: every replica's cache emptied; the same prompts then miss (and the router,
        # told by AllBlocksCleared, places them afresh).
        assert srv.request("POST", "/reset_prefix_cache")[0] == 200
        for prompt in prompts:
            status, answer = srv.request("POST", "/v1/completions", {**body, "prompt": prompt + [1, 2, 3]})
            assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert srv.request("GET", "/health")[0] == 200
        os.kill(srv.proc.pid, signal.SIGTERM)
        assert srv.proc.wait(timeout=120) == 0
    finally:
        srv.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dead_replica_fails_only_its_requests(tiny_model, backend):
    srv = dp_server(tiny_model, backend, "--request-timeout", "120")
    try:
        long = {"max_tokens": 3000, "ignore_eos": True}
        results: dict[int, tuple] = {}

        def run(i: int) -> None:
            results[i] = srv.request("POST", "/v1/completions", {**long, "prompt": [5 + i] * 40})

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for _ in bounded(lambda: per_engine(srv, "num_requests_running") != [1, 1], 3000,
                         "the two requests did not start on the two replicas"):
            threading.Event().wait(0.01)
        status, error = srv.request("POST", "/reset_prefix_cache")  # requests hold blocks: refused
        assert status == 409 and "not reset" in error["error"]["message"]
        os.kill(srv.core_pids[1], signal.SIGKILL)
        for t in threads:
            t.join(timeout=300)
        statuses = sorted(status for status, _ in results.values())
        assert statuses == [200, 503], results
        failed = next(answer for status, answer in results.values() if status == 503)
        assert "data-parallel replica 1" in failed["error"]["message"]
        # The other replica serves on, and the server says it is healthy.
        assert srv.request("GET", "/health")[0] == 200
        for i in range(3):
            assert srv.request("POST", "/v1/completions", {"prompt": [9, 8, 7, i], "max_tokens": 2})[0] == 200
        os.kill(srv.core_pids[0], signal.SIGKILL)  # the last replica: the server goes
        assert srv.proc.wait(timeout=120) == 1
    finally:
        srv.stop()
