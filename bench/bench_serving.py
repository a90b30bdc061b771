"""Online serving: vpage's OpenAI-compatible server under concurrent streaming clients,
against the same engine driven offline, in the same process and run.

    python bench/bench_serving.py [--num-requests 64] [--request-rate inf]

The trace is bench_throughput.py's (seeded, ShareGPT-like lengths, greedy, ignore_eos).
"offline" adds every request to an LLMEngine and steps it to the end. "server" starts
`OpenAIServer` on a local port with a fresh engine of the same settings (prefix caching off in
both, so neither reuses the other's prompts) and sends each request as a streaming
/v1/completions call from its own client thread, all at once (--request-rate inf) or with
Poisson arrivals. Reported: output tokens/s (and the server's ratio to offline), and for the
server TTFT (send -> first streamed token) and TPOT (time per output token after the first),
median and p99.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_throughput import make_trace  # noqa: E402

from vpage import SamplingParams  # noqa: E402
from vpage.engine import EngineArgs, LLMEngine  # noqa: E402
from vpage.engine.engine_loop import EngineLoop  # noqa: E402
from vpage.entrypoints.openai.api_server import OpenAIServer  # noqa: E402


def engine_args(args) -> EngineArgs:
    return EngineArgs(dtype=args.dtype, device="cpu", kv_cache_memory=args.kv_cache_memory,
                      max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)


def run_offline(engine: LLMEngine, trace) -> dict:
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(trace):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return {"mode": "offline", "tokens": tokens, "wall": time.perf_counter() - start}


def stream_one(address, prompt, out_len) -> tuple[float, list[float], int]:
    """(send time, arrival time of each streamed chunk, tokens in the final usage)."""
    conn = http.client.HTTPConnection(*address, timeout=600)
    body = {"prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode())
    resp = conn.getresponse()
    arrivals, tokens = [], 0
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event["choices"]:
            arrivals.append(time.perf_counter())
        elif "usage" in event:
            tokens = event["usage"]["completion_tokens"]
    conn.close()
    return sent, arrivals, tokens


def run_server(args, trace) -> dict:
    loop = EngineLoop(LLMEngine(engine_args(args)))
    server = OpenAIServer(loop, "smollm2", "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rng = np.random.default_rng(args.seed)
    gaps = ([0.0] * len(trace) if args.request_rate == float("inf")
            else rng.exponential(1.0 / args.request_rate, len(trace)).tolist())
    start = time.perf_counter()
    with ThreadPoolExecutor(len(trace)) as pool:
        futures = []
        for (prompt, out_len), gap in zip(trace, gaps):
            time.sleep(gap)
            futures.append(pool.submit(stream_one, server.server_address[:2], prompt, out_len))
        results = [f.result() for f in futures]
    wall = time.perf_counter() - start
    server.shutdown()
    server.server_close()
    loop.shutdown()
    ttft = [arrivals[0] - sent for sent, arrivals, _ in results if arrivals]
    tpot = [(arrivals[-1] - arrivals[0]) / (tokens - 1) for _, arrivals, tokens in results if tokens > 1]
    return {"mode": "server", "tokens": sum(t for _, _, t in results), "wall": wall, "ttft": ttft, "tpot": tpot}


def pct(values, q) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB of KV cache")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(engine_args(args))
    trace = make_trace(args.num_requests, args.seed, engine.model_config.vocab_size)
    offline = run_offline(engine, trace)
    del engine
    server = run_server(args, trace)
    print(f"\n{args.num_requests} requests, request rate {args.request_rate}/s, {args.dtype}, max_num_seqs "
          f"{args.max_num_seqs}, {args.threads} threads, torch {torch.__version__}\n")
    print("| mode | output tokens | wall s | output tok/s | vs offline | TTFT p50 / p99 s | TPOT p50 / p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = offline["tokens"] / offline["wall"]
    for r in (offline, server):
        rate = r["tokens"] / r["wall"]
        latency = (f"{pct(r['ttft'], 50):.2f} / {pct(r['ttft'], 99):.2f} | "
                   f"{1e3 * pct(r['tpot'], 50):.0f} / {1e3 * pct(r['tpot'], 99):.0f}") if "ttft" in r else "- | -"
        print(f"| {r['mode']} | {r['tokens']} | {r['wall']:.1f} | {rate:.1f} | {rate / base:.2f}x | {latency} |")


if __name__ == "__main__":
    main()
