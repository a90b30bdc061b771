"""``vpage bench serve``: load-tests any OpenAI-compatible ``/v1/completions`` endpoint.

The trace is a seeded synthetic ShareGPT-like one (lognormal prompt and output lengths,
prompts of random common words, about one token each) or a JSONL file of
``{"prompt": ..., "output_len": ...}`` lines. Requests stream (``ignore_eos`` asks for
exactly ``output_len`` tokens; vLLM, vpage and llama.cpp's server honour it), arrive all at
once or as a Poisson process, with at most ``--max-concurrency`` in flight. Reported:
request and output-token throughput, TTFT, TPOT, ITL and E2E (mean, median, P95, P99), and
goodput (requests/s meeting ``--slo-ttft-ms`` and ``--slo-tpot-ms``). Standard library
only, so it runs anywhere vpage is installed.

Structured outputs (the names of vLLM's benchmark_serving_structured_output.py):
``--json-schema-path FILE`` puts that JSON schema on a seeded ``--structured-output-ratio`` of
the requests (all by default), sent as vLLM's ``structured_outputs: {"json": ...}`` field;
``--unique-schemas`` gives each request its own copy (one more optional property), so no
request finds its grammar compiled already.

Several models (e.g. LoRA adapters served beside their base model): ``--models A B ...`` sends
request i with model ``models[i % len(models)]``, in place of ``--model``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

_WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
          "word but not what all were we when your can said there use an each which she do how their if will up "
          "other about out many then them these so some her would make like him into time has look two more write "
          "go see number no way could people my than first water been call who oil its now find long down day did "
          "get come made may part").split()


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    finish_reason: Optional[str] = None
    error: str = ""

    @property
    def tpot(self) -> Optional[float]:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def synthetic_trace(num: int, seed: int, prompt_median: int = 140, output_median: int = 90) -> list[tuple[str, int]]:
    """(prompt text, output length) pairs; same seed, same trace."""
    rng = random.Random(seed)
    trace = []
    for _ in range(num):
        p = int(min(max(rng.lognormvariate(math.log(prompt_median), 0.8), 16), 512))
        o = int(min(max(rng.lognormvariate(math.log(output_median), 0.7), 16), 256))
        trace.append((" ".join(rng.choice(_WORDS) for _ in range(p)), o))
    return trace


# How long a request may wait for its next bytes, 6 hours as in vLLM's benchmark client: at high
# concurrency on a small CPU a request queued behind the others' prefill waits many minutes for
# its first token, and a shorter timeout would fail it and understate the server.
REQUEST_TIMEOUT_S = 6 * 60 * 60.0


def load_jsonl(path: str) -> list[tuple[str, int]]:
    with open(path) as f:
        return [(row["prompt"], int(row["output_len"])) for row in map(json.loads, f) if row]


def _stream_one(url: str, model: Optional[str], api_key: Optional[str], prompt: str, out_len: int,
                timeout: float, schema: Optional[dict] = None) -> Result:
    parts = urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    body = {"prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if schema is not None:
        body["structured_outputs"] = {"json": schema}
    if model:
        body["model"] = model
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    result = Result()
    start = time.perf_counter()
    try:
        conn = conn_cls(parts.hostname, parts.port, timeout=timeout)
        conn.request("POST", parts.path.rstrip("/") + "/completions", json.dumps(body).encode(), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return result
        last, chunks, usage = None, 0, None
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                usage = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
            if not any(c.get("text") for c in event.get("choices") or []):
                continue
            now = time.perf_counter()
            if last is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last, chunks = now, chunks + 1
        result.e2e = time.perf_counter() - start
        result.output_tokens = usage if usage is not None else chunks
        # A request the server cut short (finish_reason "abort", or no reason at all) failed.
        result.ok = last is not None and result.finish_reason in ("length", "stop")
        if not result.ok:
            result.error = f"incomplete (finish_reason {result.finish_reason})"
        conn.close()
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _summary(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p95": None, "p99": None}
    xs = sorted(values)

    def pct(q: float) -> float:
        return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs) + 0.5)) - 1))]

    return {"mean": sum(xs) / len(xs) * 1000, "median": pct(50) * 1000, "p95": pct(95) * 1000, "p99": pct(99) * 1000}


def request_schemas(num: int, schema: Optional[dict], ratio: float = 1.0, unique: bool = False,
                    seed: int = 0) -> list[Optional[dict]]:
    """The schema of each of ``num`` requests: ``schema`` on a seeded ``ratio`` of them (None on
    the others); with ``unique``, each its own copy with one more optional property."""
    if schema is None:
        return [None] * num
    chosen = set(random.Random(seed).sample(range(num), round(num * ratio)))
    schemas: list[Optional[dict]] = []
    for i in range(num):
        if i not in chosen:
            schemas.append(None)
        elif unique:
            copy = json.loads(json.dumps(schema))
            copy.setdefault("properties", {})[f"unique_{i}"] = {"type": "boolean"}
            schemas.append(copy)
        else:
            schemas.append(schema)
    return schemas


_SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def spec_decode_counters(url: str, timeout: float = 10.0) -> Optional[dict[str, float]]:
    """The server's speculative-decoding counters from its Prometheus /metrics (vLLM's names,
    any prefix, summed over labels), or None when it does not report them."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        text = response.read().decode("utf-8", "replace") if response.status == 200 else ""
    except OSError:
        return None
    finally:
        conn.close()
    return parse_spec_decode_counters(text)


def parse_spec_decode_counters(text: str) -> Optional[dict[str, float]]:
    """The speculative-decoding counters of a Prometheus exposition, or None without them."""
    totals: dict[str, float] = {}
    for name in _SPEC_COUNTERS:
        values = re.findall(rf"^\w+:{name}_total(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)
        if values:
            totals[name] = sum(float(v) for v in values)
    return totals if len(totals) == len(_SPEC_COUNTERS) else None


def _acceptance(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """Draft acceptance over the run from two counter readings, or None without drafts."""
    if before is None or after is None:
        return None
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    drafts, tokens = delta["spec_decode_num_drafts"], delta["spec_decode_num_draft_tokens"]
    if tokens <= 0:
        return None
    accepted = delta["spec_decode_num_accepted_tokens"]
    return {"draft_tokens": tokens, "accepted_tokens": accepted, "acceptance_rate": accepted / tokens,
            "mean_acceptance_length": 1.0 + accepted / drafts}


def run_benchmark(url: str, trace: list[tuple[str, int]], *, model: Optional[str] = None, api_key: Optional[str] = None,
                  request_rate: float = float("inf"), max_concurrency: int = 64, seed: int = 0,
                  slo_ttft_ms: Optional[float] = None, slo_tpot_ms: Optional[float] = None,
                  timeout: float = REQUEST_TIMEOUT_S,
                  progress: bool = True, schemas: Optional[list[Optional[dict]]] = None,
                  models: Optional[list[str]] = None) -> dict:
    """Sends the trace to ``url`` (ending in /v1) and returns the report (times in ms);
    ``schemas[i]``, when given and not None, constrains request i to that JSON schema; with
    ``models``, request i names ``models[i % len(models)]`` (round-robin) in place of ``model``."""
    rng = random.Random(seed)
    results: list[Result] = []
    lock = threading.Lock()
    done = 0
    schemas = schemas or [None] * len(trace)

    def one(item: tuple[str, int], schema: Optional[dict], name: Optional[str]) -> None:
        nonlocal done
        r = _stream_one(url, name, api_key, item[0], item[1], timeout, schema)
        with lock:
            results.append(r)
            done += 1
            if progress:
                bar = "#" * (30 * done // len(trace))
                sys.stderr.write(f"\r[{bar:<30}] {done}/{len(trace)}")
                sys.stderr.flush()

    counters_before = spec_decode_counters(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, max_concurrency)) as pool:
        for i, (item, schema) in enumerate(zip(trace, schemas)):
            pool.submit(one, item, schema, models[i % len(models)] if models else model)
            if request_rate != float("inf"):
                time.sleep(rng.expovariate(request_rate))
    wall = time.perf_counter() - start
    spec = _acceptance(counters_before, spec_decode_counters(url))
    if progress:
        sys.stderr.write("\n")
    ok = [r for r in results if r.ok]
    good = [r for r in ok if (slo_ttft_ms is None or r.ttft * 1000 <= slo_ttft_ms)
            and (slo_tpot_ms is None or (r.tpot or 0) * 1000 <= slo_tpot_ms)]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "url": url, "num_requests": len(trace), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "request_rate": "inf" if request_rate == float("inf") else request_rate, "max_concurrency": max_concurrency,
        "structured_requests": sum(s is not None for s in schemas), "models": list(models) if models else None,
        "duration_s": wall, "request_throughput": len(ok) / wall, "output_throughput": output_tokens / wall,
        "total_output_tokens": output_tokens, "goodput": len(good) / wall,
        "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
        "ttft_ms": _summary([r.ttft for r in ok]), "tpot_ms": _summary([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _summary([x for r in ok for x in r.itl]), "e2e_ms": _summary([r.e2e for r in ok]),
        "spec_decode": spec,
    }


def format_report(report: dict) -> str:
    lines = [f"requests: {report['completed']} ok, {report['failed']} failed in {report['duration_s']:.1f} s"
             + (f" ({report['structured_requests']} with a JSON schema)" if report.get("structured_requests") else ""),
             f"request throughput: {report['request_throughput']:.2f} req/s, "
             f"output: {report['output_throughput']:.1f} tok/s, goodput: {report['goodput']:.2f} req/s"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = report[name]
        if s["mean"] is not None:
            lines.append(f"{name[:-3].upper():>5} ms  mean {s['mean']:9.1f}  median {s['median']:9.1f}  "
                         f"p95 {s['p95']:9.1f}  p99 {s['p99']:9.1f}")
    spec = report.get("spec_decode")
    if spec:
        lines.append(f"speculative decoding: {spec['acceptance_rate']:.1%} of {spec['draft_tokens']:.0f} draft tokens "
                     f"accepted, mean acceptance length {spec['mean_acceptance_length']:.2f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument("--model", default=None, help="model name to send (default: none, the server's own)")
    parser.add_argument("--models", nargs="+", default=None, metavar="NAME",
                        help="model names sent round-robin over the requests (e.g. LoRA adapters), "
                             "in place of --model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset", default=None, help="JSONL of {prompt, output_len} (default: synthetic)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate (default: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tpot-ms", type=float, default=None)
    parser.add_argument("--timeout", type=float, default=REQUEST_TIMEOUT_S,
                        help="seconds a request may wait for its next bytes (default 6 hours)")
    parser.add_argument("--json-schema-path", default=None, metavar="FILE",
                        help="constrain requests to this JSON schema (structured outputs)")
    parser.add_argument("--structured-output-ratio", type=float, default=1.0,
                        help="the share of requests that carry the schema (default: 1, all)")
    parser.add_argument("--unique-schemas", action="store_true",
                        help="a distinct copy of the schema per request (none is compiled already)")
    parser.add_argument("--result-file", default=None, help="write the report as JSON here")
    parser.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    trace = load_jsonl(args.dataset) if args.dataset else synthetic_trace(args.num_prompts, args.seed)
    trace = trace[:args.num_prompts]
    if not 0.0 <= args.structured_output_ratio <= 1.0:
        raise SystemExit("--structured-output-ratio must be within [0, 1]")
    schema = None
    if args.json_schema_path:
        with open(args.json_schema_path) as f:
            schema = json.load(f)
    schemas = request_schemas(len(trace), schema, args.structured_output_ratio, args.unique_schemas, args.seed)
    report = run_benchmark(args.base_url, trace, model=args.model, api_key=args.api_key,
                           request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
                           slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, timeout=args.timeout,
                           progress=not args.no_progress, schemas=schemas, models=args.models)
    print(format_report(report))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["completed"] else 1
