"""Starts `vpage serve` as a child process on a free local port, for the server tests."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

import psutil

_URL = re.compile(rb"serving \S+ on (http://127\.0\.0\.1:(\d+)/v1) \(engine core pids? ([\d, ]+)\)")


class LiveServer:
    """`vpage serve ARGS` on 127.0.0.1 with port 0; ``port``, ``base_url`` (ending in /v1),
    ``core_pid`` (``core_pids``: one per data-parallel replica); ``stop()`` kills every process
    if it is still there."""

    def __init__(self, *args: str, env: Optional[dict] = None, start_timeout: float = 240.0):
        self.proc = subprocess.Popen([sys.executable, "-m", "vpage.cli", "serve", "--host", "127.0.0.1",
                                      "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
                                     start_new_session=True)
        self.output: list[bytes] = []
        found = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.output.append(line)
                match = _URL.search(line)
                if match:
                    self.base_url, self.port = match.group(1).decode(), int(match.group(2))
                    self.core_pids = [int(pid) for pid in match.group(3).split(b",")]
                    self.core_pid = self.core_pids[0]
                    found.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + start_timeout
        while not found.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:  # exited (its output read), or stuck
                reader.join(timeout=5)
                self.stop()
                raise RuntimeError("vpage serve did not start:\n" + b"".join(self.output).decode(errors="replace"))

    def request(self, method: str, path: str, body=None, headers: Optional[dict] = None, raw: Optional[bytes] = None,
                timeout: float = 120.0) -> tuple[int, dict]:
        """(status, parsed JSON body) of one request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        status, payload = resp.status, resp.read()
        conn.close()
        return status, json.loads(payload) if payload.startswith(b"{") else {"raw": payload.decode(errors="replace")}

    def metric(self, name: str) -> float:
        """The value of ``vpage:NAME{model_name=...}`` in /metrics (summed over labels)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f"vpage:{name}{{"))

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until /metrics shows nothing running or waiting and no KV block in use."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (self.metric("num_requests_running"), self.metric("num_requests_waiting"),
                    self.metric("kv_cache_usage_perc")) == (0, 0, 0):
                return
            time.sleep(0.1)
        raise AssertionError("the server did not become idle")

    def stop(self) -> None:
        for pid in (self.proc.pid, *getattr(self, "core_pids", [])):
            if pid is not None and psutil.pid_exists(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait(timeout=30)


def stream_events(server: LiveServer, path: str, body: dict, headers: Optional[dict] = None) -> list[dict]:
    """The parsed `data:` events of a streamed request up to [DONE] (which must come)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(), headers=headers or {})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    events = []
    for block in resp.read().decode().split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ")
        if block == "data: [DONE]":
            break
        events.append(json.loads(block[len("data: "):]))
    else:
        raise AssertionError("the stream did not end with [DONE]")
    conn.close()
    return events


TOOL_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hermes_tool_template.jinja")


def tool_server() -> LiveServer:
    """The default model served with a Hermes-style tool template (hermes_tool_template.jinja),
    the hermes tool-call parser and the qwen3 reasoning parser."""
    return LiveServer("--dtype", "float32", "--kv-cache-memory", "0.25", "--max-model-len", "1024",
                      "--max-num-seqs", "4", "--chat-template", TOOL_TEMPLATE, "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
