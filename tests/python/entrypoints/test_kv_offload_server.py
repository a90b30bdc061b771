"""``vpage serve --kv-offloading-size ... --kv-offloading-disk-path DIR``: prefixes evicted from a
small KV cache reach the disk, and a server restarted on the same folder serves them again (in
``cached_tokens`` and the external prefix-cache metrics), with the same text as a cold server."""

from __future__ import annotations

import os
import signal

import pytest

from live_server import LiveServer
from model_fixtures import save_tiny_model

BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4  # layers x (K, V) x kv heads x head size x 16 tokens x float32
GiB = 2**30


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kv-offload-server")
    save_tiny_model("llama", path, seed=7)
    return path


def prompt(i: int) -> list[int]:
    return [(29 * i + 13 * k + 7) % 250 + 3 for k in range(100)]


def start(folder, disk=None) -> LiveServer:
    # 12 KV blocks of 16 tokens: a 100-token prompt takes 7, so each prompt evicts the one before.
    flags = ["--model", str(folder), "--dtype", "float32", "--max-model-len", "128",
             "--kv-cache-memory", str(12 * BLOCK_BYTES / GiB)]
    if disk is not None:
        # A host tier of 8 blocks (more than a step evicts), the rest on disk.
        flags += ["--swap-space", "0", "--kv-offloading-size", str(8 * BLOCK_BYTES / GiB),
                  "--kv-offloading-disk-path", str(disk), "--kv-offloading-disk-size", str(256 * BLOCK_BYTES / GiB)]
    return LiveServer(*flags)


def complete(server: LiveServer, folder, i: int) -> tuple[str, int]:
    status, body = server.request("POST", "/v1/completions", {"model": str(folder), "prompt": prompt(i),
                                                              "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def drain(server: LiveServer) -> None:
    """SIGTERM: the server drains and exits, its queued disk writes done."""
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=120) == 0


def test_a_restarted_server_serves_evicted_prefixes_from_disk(folder, tmp_path):
    cold = start(folder)
    try:
        texts = [complete(cold, folder, i)[0] for i in range(5)]
    finally:
        cold.stop()

    first = start(folder, tmp_path)
    try:
        assert [complete(first, folder, i) for i in range(5)] == [(text, 0) for text in texts]
        drain(first)
    finally:
        first.stop()
    assert any(name.endswith(".kv") for _, _, names in os.walk(tmp_path) for name in names)

    restarted = start(folder, tmp_path)
    try:
        assert complete(restarted, folder, 0) == (texts[0], 96)  # every full block before the last token
        assert restarted.metric("external_prefix_cache_hits_total") == 6
    finally:
        restarted.stop()
