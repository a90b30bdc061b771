"""`vpage bench serve` without a server: the seeded trace, JSONL input, and a report (with
every request failed) when nothing listens at the URL."""

from __future__ import annotations

import json
import socket

from vpage.benchmarks.serve import load_jsonl, synthetic_trace
from vpage.cli import main as cli_main


def test_synthetic_trace_is_seeded_and_shaped():
    a, b = synthetic_trace(50, seed=3), synthetic_trace(50, seed=3)
    assert a == b and a != synthetic_trace(50, seed=4)
    assert all(16 <= len(p.split()) <= 512 and 16 <= o <= 256 for p, o in a)


def test_cli_reports_failures_against_a_closed_port(tmp_path):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dataset = tmp_path / "trace.jsonl"
    dataset.write_text("\n".join(json.dumps({"prompt": f"hello {i}", "output_len": 4}) for i in range(3)) + "\n")
    assert load_jsonl(str(dataset)) == [(f"hello {i}", 4) for i in range(3)]
    result = tmp_path / "result.json"
    assert cli_main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}/v1", "--dataset", str(dataset),
                     "--no-progress", "--result-file", str(result), "--timeout", "5"]) == 1
    report = json.loads(result.read_text())
    assert report["num_requests"] == 3 and report["completed"] == 0 and report["failed"] == 3
    assert report["errors"] and report["ttft_ms"]["p99"] is None


def test_request_schemas_ratio_and_unique_copies():
    from vpage.benchmarks.serve import request_schemas

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert request_schemas(4, None) == [None] * 4
    half = request_schemas(10, schema, ratio=0.5, seed=1)
    assert half == request_schemas(10, schema, ratio=0.5, seed=1) and sum(s is not None for s in half) == 5
    unique = request_schemas(3, schema, unique=True)
    assert len({json.dumps(s, sort_keys=True) for s in unique}) == 3
    assert all(s["required"] == ["a"] and "a" in s["properties"] for s in unique) and schema["properties"].keys() == {"a"}
