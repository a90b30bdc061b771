"""Online serving vs the offline engine, in the same run: `vpage serve` under concurrent
streaming clients (`vpage bench serve`'s client), against an LLMEngine stepped directly.

    python bench/bench_serving.py [--num-requests 256] [--max-concurrency 64]

Both run the same seeded synthetic ShareGPT-like trace of text prompts (greedy,
ignore_eos, prefix caching off in both). "offline" adds every request to an LLMEngine and
steps it to the end. "server" starts `vpage serve` (API process + engine-core process) on
a free local port and streams every request through /v1/completions. Reported: output
tokens/s (and the server's ratio to offline), and the server's TTFT/TPOT/ITL percentiles.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from vpage import SamplingParams
from vpage.benchmarks.serve import format_report, run_benchmark, synthetic_trace
from vpage.engine import EngineArgs, LLMEngine

_URL = re.compile(r"serving \S+ on (http://\S+/v1)")


def run_offline(args, trace) -> dict:
    engine = LLMEngine(EngineArgs(dtype=args.dtype, device="cpu", kv_cache_memory=args.kv_cache_memory,
                                  max_num_seqs=args.max_num_seqs, enable_prefix_caching=False))
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(trace):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return {"tokens": tokens, "wall": time.perf_counter() - start}


def start_vpage_serve(flags: list[str]) -> tuple[subprocess.Popen, str]:
    """`vpage serve --port 0 FLAGS` on the CPU: the process and its base URL (ending in /v1),
    once it serves."""
    # Only stdout is piped (its start line, read here; nothing after): the server's logs go to
    # stderr, which a pipe nobody reads would fill and stall.
    proc = subprocess.Popen([sys.executable, "-m", "vpage.cli", "serve", "--port", "0", "--device", "cpu", *flags],
                            stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        match = _URL.search(line)
        if match:
            return proc, match.group(1)
    raise RuntimeError("vpage serve did not start (its error is above)")


def start_server(args) -> tuple[subprocess.Popen, str]:
    return start_vpage_serve(["--dtype", args.dtype, "--kv-cache-memory", str(args.kv_cache_memory),
                              "--max-num-seqs", str(args.max_num_seqs), "--no-prefix-caching"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB of KV cache")
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    trace = synthetic_trace(args.num_requests, args.seed)
    offline = run_offline(args, trace)
    proc, url = start_server(args)
    try:
        report = run_benchmark(url, trace, max_concurrency=args.max_concurrency, seed=args.seed)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    base = offline["tokens"] / offline["wall"]
    report["offline_output_throughput"] = base
    report["vs_offline"] = report["output_throughput"] / base
    print(f"\n{args.num_requests} requests, concurrency {args.max_concurrency}, {args.dtype}, max_num_seqs "
          f"{args.max_num_seqs}, {os.cpu_count()} CPUs")
    print(f"offline: {offline['tokens']} tokens in {offline['wall']:.1f} s = {base:.1f} tok/s")
    print(format_report(report))
    print(f"server / offline output tok/s: {report['vs_offline']:.2f}x")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
