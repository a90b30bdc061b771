"""`vpage serve` on a tiny random model: API keys and tenant isolation, load shedding,
SIGTERM drain, and the engine-core process dying. Each test starts and stops its own server."""

from __future__ import annotations

import glob
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from bounded_loops import bounded
from live_server import LiveServer
from model_fixtures import save_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", folder, max_position_embeddings=4096)  # room for long requests
    return str(folder)


def tiny_server(model: str, *extra: str, env=None) -> LiveServer:
    return LiveServer("--model", model, "--dtype", "float32", "--kv-cache-memory", "0.02", "--max-num-seqs", "2",
                      *extra, env=env)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_api_keys_tenant_isolation_and_load_shedding(tiny_model, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# TENANT KEY\nalice key-alice\nbob key-bob\n")
    srv = tiny_server(tiny_model, "--api-keys", str(keys), "--max-waiting-requests", "2")
    try:
        body = {"prompt": list(range(3, 103)), "max_tokens": 2}  # 100 tokens: 6 full KV blocks
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-alice"}):
            status, error = srv.request("POST", "/v1/completions", body, headers=headers)
            assert status == 401 and error["error"]["type"] == "authentication_error"
        assert srv.request("GET", "/v1/models")[0] == 401
        assert srv.request("GET", "/health")[0] == 200 and srv.request("GET", "/metrics")[0] == 200

        def cached(key: str) -> int:
            status, answer = srv.request("POST", "/v1/completions", body, headers={"Authorization": f"Bearer {key}"})
            assert status == 200, answer
            return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("key-alice") == 0 and cached("key-alice") >= 96  # hits within a tenant
        assert cached("key-bob") == 0 and cached("key-bob") >= 96  # none across tenants
        status, answer = srv.request("POST", "/v1/completions", {**body, "cache_salt": "mine"},
                                     headers={"Authorization": "Bearer key-alice"})
        assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        def one(i: int) -> tuple[int, str]:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
            conn.request("POST", "/v1/completions", json.dumps({"prompt": [5, 6, 7, i + 8], "max_tokens": 200,
                                                                "ignore_eos": True}),
                         {"Authorization": "Bearer key-bob"})
            resp = conn.getresponse()
            resp.read()
            conn.close()
            return resp.status, resp.getheader("Retry-After")

        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(one, range(12)))
        assert {s for s, _ in results} == {200, 503}, results
        assert all(retry == "1" for s, retry in results if s == 503)
        srv.wait_idle()
        os.kill(srv.proc.pid, signal.SIGKILL)  # the API process dies hard: the core must follow
        deadline = time.monotonic() + 15
        while not gone(srv.core_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(srv.core_pid)
    finally:
        srv.stop()


def test_sigterm_drains_then_aborts_and_exits_0(tiny_model):
    srv = tiny_server(tiny_model, "--drain-timeout", "0")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": [5, 6, 7], "max_tokens": 250, "ignore_eos": True,
                                                            "stream": True}))
        resp = conn.getresponse()
        assert resp.readline().startswith(b"data: ")  # generating
        os.kill(srv.proc.pid, signal.SIGTERM)
        events = [b for b in resp.read().decode().split("\n\n") if b]
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "abort"
        assert srv.proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while not gone(srv.core_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(srv.core_pid)  # no orphan engine core
    finally:
        srv.stop()


def test_sigint_lets_running_requests_finish(tiny_model):
    srv = tiny_server(tiny_model, "--drain-timeout", "60")
    try:
        result = {}

        def client() -> None:
            result["answer"] = srv.request("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 40})

        thread = threading.Thread(target=client)
        thread.start()
        for _ in bounded(lambda: thread.is_alive() and srv.metric("num_requests_running") == 0, 3000,
                         "the request did not start"):
            time.sleep(0.01)
        os.kill(srv.proc.pid, signal.SIGINT)
        thread.join(60)
        status, answer = result["answer"]
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()


def test_request_timeout_then_killing_the_engine_core_gives_503_and_the_server_exits(tiny_model):
    srv = tiny_server(tiny_model, "--request-timeout", "1")
    try:
        long = {"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True}
        status, error = srv.request("POST", "/v1/completions", long)
        assert status == 504 and error["error"]["type"] == "timeout_error"
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({**long, "stream": True}))
        events = [b for b in conn.getresponse().read().decode().split("\n\n") if b]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "abort"
        srv.wait_idle()
        assert srv.request("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})[0] == 200
        os.kill(srv.core_pid, signal.SIGKILL)
        status, error = srv.request("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 200})
        assert status == 503 and error["error"]["code"] == 503
        assert srv.request("GET", "/health")[0] == 503
        assert srv.proc.wait(timeout=30) == 1
    finally:
        srv.stop()


def socket_dirs() -> set[str]:
    """The engine-core socket directories in the temporary folder (core_client's prefix)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "vpage-core-*")))


def test_a_killed_server_leaves_no_socket_directory(tiny_model):
    before = socket_dirs()
    srv = tiny_server(tiny_model)
    try:
        assert srv.request("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})[0] == 200
        assert socket_dirs() <= before  # removed as soon as the engine core was connected
    finally:
        srv.stop()  # SIGKILL to both processes: no cleanup code runs
    assert socket_dirs() <= before


def test_serve_reports_a_missing_model(tmp_path):
    done = subprocess.run([sys.executable, "-m", "vpage.cli", "serve", "--model", str(tmp_path / "absent"),
                           "--port", "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "vpage: error:" in done.stderr


def test_a_dead_tensor_parallel_worker_fails_requests_with_503_and_the_server_exits(tiny_model):
    srv = tiny_server(tiny_model, "--tensor-parallel-size", "2")
    try:
        assert srv.request("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})[0] == 200
        workers = [p for p in psutil.Process(srv.core_pid).children()
                   if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(workers) == 1  # rank 1, spawned by the engine core (rank 0)
        result = {}
        long = threading.Thread(target=lambda: result.update(r=srv.request(
            "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True})))
        long.start()
        time.sleep(1.0)
        workers[0].kill()
        long.join(timeout=60)
        status, error = result["r"]
        assert status == 503 and "tensor-parallel worker" in error["error"]["message"]
        assert srv.proc.wait(timeout=30) == 1  # for a supervisor to restart it
        assert gone(srv.core_pid) and gone(workers[0].pid)
    finally:
        srv.stop()
