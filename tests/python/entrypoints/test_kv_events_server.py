"""``vpage serve --kv-events-config``: the engine-core process publishes the prefix cache's
changes (vLLM's ZeroMQ format) while the server answers; a bad configuration stops the server
before it listens, with the reason."""

from __future__ import annotations

import json
import time

import pytest
import zmq

from live_server import LiveServer
from model_fixtures import save_tiny_model
from vpage.distributed.kv_events import decode_batch


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kv-events-server")
    save_tiny_model("llama", path)
    return path


def test_a_served_request_publishes_its_blocks(folder, tmp_path):
    endpoint = f"ipc://{tmp_path}/kv-events"
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "kv-events"}
    server = LiveServer("--model", str(folder), "--dtype", "float32", "--kv-cache-memory", "0.01",
                        "--kv-events-config", json.dumps(config))
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        time.sleep(0.5)  # a PUB socket drops what it sends before the subscription arrives
        prompt = list(range(3, 43))  # 40 tokens: blocks of 16
        status, body = server.request("POST", "/v1/completions", {"model": str(folder), "prompt": prompt,
                                                                  "max_tokens": 24, "ignore_eos": True})
        assert status == 200, body
        hashes, tokens = [], []
        for _ in range(100):
            if len(hashes) == 3:  # 63 computed tokens: 3 full blocks
                break
            assert sub.poll(10_000), "no KV event batch"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            for event in decode_batch(payload)[1]:
                assert event["type"] == "BlockStored" and event["block_size"] == 16
                assert event["parent_block_hash"] == (hashes[-1] if hashes else None)
                hashes += event["block_hashes"]
                tokens += event["token_ids"]
        assert len(hashes) == 3 and tokens[:40] == prompt and len(tokens) == 48
    finally:
        sub.close(linger=0)
        server.stop()


def test_a_bad_configuration_stops_the_server_before_it_listens(folder):
    with pytest.raises(RuntimeError, match="unknown keys"):
        LiveServer("--model", str(folder), "--kv-events-config", '{"enable_kv_cache_events": true, "topc": "x"}',
                   start_timeout=120)
