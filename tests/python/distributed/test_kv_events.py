"""KV cache events (``kv_events_config``): the C++ scheduler's log as vLLM's tagged event maps
(chains merged, removals grouped), and an engine publishing them over ZeroMQ as vLLM's
subscribers read them: topic, consecutive sequence numbers, msgpack ``[ts, events, rank]``,
stored chains whose tokens are the request's, no event for a prefix hit, the replay socket
resending every batch; bad configurations raise before anything runs."""

from __future__ import annotations

import socket

import pytest
import zmq

from model_fixtures import save_tiny_model
from vpage import SamplingParams, _core
from vpage.config import KVEventsConfig
from vpage.distributed.kv_events import END_SEQ, decode_batch, wire_events
from vpage.engine import EngineArgs, LLMEngine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_one(scheduler, request_id: str, prompt: list[int]) -> None:
    stop = _core.StopConditions(max_tokens=1, eos_token_ids=[0])
    scheduler.add_sequence_group(request_id, prompt, 1, stop, 0.0)
    plan = scheduler.schedule()
    seq_ids = list(plan.sample_seq_ids)
    scheduler.commit(seq_ids, [7] * len(seq_ids))


def test_wire_events_merge_a_chain_and_group_removals():
    config = _core.BlockManagerConfig(block_size=4, num_gpu_blocks=8, watermark=0.0, enable_kv_cache_events=True)
    scheduler = _core.Scheduler(_core.SchedulerConfig(), config)
    _run_one(scheduler, "a", list(range(1, 14)))
    stored = scheduler.take_kv_events()
    assert [e.kind for e in stored] == [_core.KvCacheEventKind.STORED] * 3
    assert all(len(e.block_hash) == 16 for e in stored) and len({e.block_hash for e in stored}) == 3
    (event,) = wire_events(stored, 4)
    assert event == {"type": "BlockStored", "block_hashes": [e.block_hash for e in stored], "parent_block_hash": None,
                     "token_ids": list(range(1, 13)), "block_size": 4, "lora_id": None, "medium": "GPU",
                     "lora_name": None}
    _run_one(scheduler, "b", list(range(1000, 1029)))  # takes all 8 blocks: evicts a's 3
    removed, chain = wire_events(scheduler.take_kv_events(), 4)
    assert removed == {"type": "BlockRemoved", "block_hashes": removed["block_hashes"], "medium": "GPU"}
    assert sorted(removed["block_hashes"]) == sorted(e.block_hash for e in stored)
    assert chain["token_ids"] == list(range(1000, 1028)) and len(chain["block_hashes"]) == 7
    quiet = _core.Scheduler(_core.SchedulerConfig(), _core.BlockManagerConfig(block_size=4, num_gpu_blocks=8))
    _run_one(quiet, "a", list(range(1, 14)))
    assert quiet.take_kv_events() == []


def test_config_is_checked_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="unknown keys"):
        EngineArgs(kv_events_config={"enable_kv_cache_events": True, "endpont": "tcp://*:1"})
    with pytest.raises(ValueError, match="publisher"):
        EngineArgs(kv_events_config={"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineArgs(kv_events_config="{enable")
    with pytest.raises(ValueError, match="enable_prefix_caching is off"):
        EngineArgs(kv_events_config={"enable_kv_cache_events": True}, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="not runner 'pooling'"):
        EngineArgs(kv_events_config={"enable_kv_cache_events": True}, runner="pooling")
    assert KVEventsConfig.from_dict({}).publisher == "null"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kv-events")
    save_tiny_model("llama", path)
    return path


def test_engine_publishes_what_vllm_subscribers_read(folder):
    port, replay_port = _free_port(), _free_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv"}
    engine = LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", kv_cache_memory=0.02,
                                  kv_events_config=config))
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    replay = context.socket(zmq.DEALER)
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        prompt = list(range(3, 43))  # 40 tokens: 2 full blocks of 16, then 24 outputs fill 2 more
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        outputs = []
        for request_id in ("first", "again"):
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            for _ in range(100):
                if not engine.has_unfinished_requests():
                    break
                outputs += [o for o in engine.step() if o.finished]
        tokens = prompt + list(outputs[0].outputs[0].token_ids)
        assert outputs[1].outputs[0].token_ids == outputs[0].outputs[0].token_ids

        # Everything published so far, from the replay socket (a subscriber that joined late).
        replay.send_multipart((b"", (0).to_bytes(8, "big")))
        batches = []
        for _ in range(1000):
            assert replay.poll(10_000), "no replay answer"
            _, topic, seq, payload = replay.recv_multipart()
            if seq == END_SEQ:
                break
            assert topic == b"kv"
            batches.append((int.from_bytes(seq, "big"), payload))
        assert [seq for seq, _ in batches] == list(range(len(batches)))
        events = []
        for _, payload in batches:
            ts, batch_events, rank = decode_batch(payload)
            assert ts > 0 and rank == 0
            events += batch_events
        assert all(e["type"] == "BlockStored" for e in events)  # the cache never filled up
        hashes = [h for e in events for h in e["block_hashes"]]
        # Full computed blocks (the last output is never computed); the second request only hit.
        assert len(hashes) == len(set(hashes)) == (len(tokens) - 1) // 16
        assert sum((e["token_ids"] for e in events), []) == tokens[:len(hashes) * 16]
        for i, event in enumerate(events):
            assert event["block_size"] == 16 and event["medium"] == "GPU" and event["lora_id"] is None
            assert len(event["token_ids"]) == 16 * len(event["block_hashes"])
            assert event["parent_block_hash"] == (None if i == 0 else events[i - 1]["block_hashes"][-1])

        # The live subscriber gets the next request's batches (after those it got before).
        engine.add_request("other", {"prompt_token_ids": list(range(200, 234))}, params)
        while engine.has_unfinished_requests():
            engine.step()
        for _ in range(1000):
            assert sub.poll(10_000), "no live batch"
            topic, seq, payload = sub.recv_multipart()
            if int.from_bytes(seq, "big") >= len(batches):
                break
        assert topic == b"kv" and int.from_bytes(seq, "big") == len(batches)
        first = decode_batch(payload)[1][0]
        assert first["parent_block_hash"] is None and first["token_ids"][:16] == list(range(200, 216))

        # reset_prefix_cache: one AllBlocksCleared batch at once (no step needed), then the first
        # prompt misses.
        assert engine.reset_prefix_cache()
        for _ in range(1000):
            assert sub.poll(10_000), "no AllBlocksCleared batch"
            events = decode_batch(sub.recv_multipart()[2])[1]
            if events == [{"type": "AllBlocksCleared"}]:
                break
        engine.add_request("cold", {"prompt_token_ids": prompt}, params)
        cold = []
        while engine.has_unfinished_requests():
            cold += [o for o in engine.step() if o.finished]
        assert cold[0].num_cached_tokens == 0 and cold[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    finally:
        sub.close(linger=0)
        replay.close(linger=0)
        engine.shutdown()


def test_an_endpoint_that_cannot_be_bound_fails_the_engine_start(folder):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match="cannot open"):
            LLMEngine(EngineArgs(model=str(folder), dtype="float32", device="cpu", kv_cache_memory=0.02,
                                 kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}))
