"""Tiered KV cache: prefixes evicted from the KV cache kept in CPU memory or on disk, against recomputing them.

    python bench/bench_kv_offload.py [--configs recompute,cpu,disk,disk-restart,fits] [--conversations 96]
        [--turns 1] [--concurrency 1] [--system-prompts 48] [--system-words 300] [--kv-cache-memory 0.15]
        [--offloading-size 2] [--disk-cpu-size 0.05] [--disk-size 4] [--work-dir DIR] [--json OUT] [--model M]

The chat trace of bench_dp_routing.py (same flags, same seeded generator), sent to one fresh
`vpage serve` (one engine) per configuration, each with a KV cache (``--kv-cache-memory``) too small
for the trace's working set. By default each conversation is one turn (one of 48 system prompts, then
a new message), one at a time, so a request's TTFT is its own prefill: the KV cache holds about ten
of the system prompts, the tiers all of them.

recompute     no tier: an evicted prefix is computed again
cpu           ``--kv-offloading-size OFFLOADING_SIZE`` GiB of CPU memory, enough for the working set
disk          ``--swap-space 0 --kv-offloading-size DISK_CPU_SIZE`` (less than the working set) and a
              disk tier, ``--kv-offloading-disk-path DIR --kv-offloading-disk-size DISK_SIZE``, DIR a
              fresh folder under ``--work-dir``
disk-restart  after disk: a new server on the same disk flags and DIR, the trace again; the
              prefixes come from the disk that the previous server wrote
fits          no tier, a KV cache of ``--fits-kv-cache-memory`` GiB that holds the working set: the
              best any tier can do

Each server answers one short request before the trace. Reported per configuration: prompt tokens,
those served from a cache or tier (``usage.prompt_tokens_details.cached_tokens``) and the hit rate,
TTFT p50/p90, the trace's end-to-end time, and TTFT p50 over recompute's (target: at most 0.5x).
With several turns most requests find their conversation's previous turn still in the KV cache and
TTFT p50 tells the tiers apart less (``--turns 3 --concurrency 4``: a KV cache holding everything
gave 0.66x on 2 EPYC cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dp_routing  # noqa: E402
from bench_attention import machine_description  # noqa: E402
from vpage import _core  # noqa: E402

CONFIGS = ("recompute", "cpu", "disk", "disk-restart", "fits")


def send_trace(args: argparse.Namespace, port: int, trace) -> tuple[list[tuple[float, int, int]], float]:
    """(TTFT in s, prompt tokens, cached prompt tokens) per request, and the end-to-end time."""
    requests: list[tuple[float, int, int]] = []

    def conversation(system: str, messages: list[str]) -> None:
        history = system
        for message in messages:
            history += f"\nUser: {message}\nAssistant:"
            ttft, reply, usage = bench_dp_routing.complete(port, history, args.max_tokens)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            requests.append((ttft, usage["prompt_tokens"], cached))
            history += reply

    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for future in [pool.submit(conversation, s, m) for s, m in trace]:
            future.result()
    return requests, time.perf_counter() - start


def run_config(args: argparse.Namespace, config: str, flags: list[str], trace) -> dict:
    proc, port = bench_dp_routing.start_server(args, flags, os.path.join(args.work_dir, f"{config}.log"))
    try:
        bench_dp_routing.complete(port, "warm up", 2)
        requests, elapsed = send_trace(args, port, trace)
    finally:
        bench_dp_routing.stop_server(proc)
    ttfts = sorted(r[0] for r in requests)
    prompt, cached = sum(r[1] for r in requests), sum(r[2] for r in requests)
    return {"config": config, "requests": len(requests), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / max(1, prompt), "ttft_p50": statistics.median(ttfts),
            "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))], "elapsed": elapsed}


def config_flags(args: argparse.Namespace, config: str, disk_dir: str) -> list[str]:
    if config == "recompute":
        return []
    if config == "fits":
        return ["--kv-cache-memory", str(args.fits_kv_cache_memory)]
    if config == "cpu":
        return ["--kv-offloading-size", str(args.offloading_size)]
    # No swap space: the CPU tier is DISK_CPU_SIZE alone (free swap blocks would hold offloaded ones too).
    return ["--swap-space", "0", "--kv-offloading-size", str(args.disk_cpu_size), "--kv-offloading-disk-path", disk_dir,
            "--kv-offloading-disk-size", str(args.disk_size)]


def print_table(rows: list[dict]) -> None:
    base = next((row["ttft_p50"] for row in rows if row["config"] == "recompute"), None)
    print("\n| config | requests | prompt tokens | cached tokens | hit rate | TTFT p50 ms | TTFT p90 ms | elapsed s "
          "| TTFT p50 / recompute |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ratio = f"{row['ttft_p50'] / base:.2f}x" if base else "-"
        print(f"| {row['config']} | {row['requests']} | {row['prompt_tokens']} | {row['cached_tokens']} | "
              f"{row['hit_rate']:.3f} | {row['ttft_p50'] * 1000:.0f} | {row['ttft_p90'] * 1000:.0f} | "
              f"{row['elapsed']:.1f} | {ratio} |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, run in this order")
    parser.add_argument("--model", default=None, help="default: vpage's default model")
    parser.add_argument("--conversations", type=int, default=96)
    parser.add_argument("--turns", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="conversations at a time; their prompts must fit the KV cache together")
    parser.add_argument("--system-prompts", type=int, default=48)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--user-words", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-memory", type=float, default=0.15, help="GiB, less than the working set")
    parser.add_argument("--fits-kv-cache-memory", type=float, default=2.0, help="GiB of KV cache for fits")
    parser.add_argument("--offloading-size", type=float, default=2.0, help="GiB of CPU tier for cpu")
    parser.add_argument("--disk-cpu-size", type=float, default=0.05, help="GiB of CPU tier for disk, disk-restart")
    parser.add_argument("--disk-size", type=float, default=4.0, help="GiB of disk tier")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default="bench-kv-offload", help="server logs and the disk tier's folder")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the numbers to OUT")
    args = parser.parse_args()
    args.configs = args.configs.split(",")
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {CONFIGS}")
    if "disk-restart" in args.configs and "disk" not in args.configs[:args.configs.index("disk-restart")]:
        parser.error("disk-restart needs disk before it (it reads the disk that disk wrote)")
    return args


def main() -> int:
    args = parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    trace = bench_dp_routing.make_trace(args)
    print(f"machine: {machine_description()}, CPU ISA {_core.cpu_isa()}; {args.conversations} conversations x "
          f"{args.turns} turns under {args.system_prompts} system prompts of {args.system_words} words, "
          f"{args.concurrency} at a time, {args.max_tokens} tokens per reply; KV cache {args.kv_cache_memory} GiB",
          flush=True)
    rows = []
    # The disk tier's folder, shared by disk and disk-restart, removed at the end.
    with tempfile.TemporaryDirectory(prefix="disk-tier-", dir=args.work_dir) as disk_dir:
        for config in args.configs:
            row = run_config(args, config, config_flags(args, config, disk_dir), trace)
            rows.append(row)
            print(f"  {config}: hit rate {row['hit_rate']:.3f}, TTFT p50 {row['ttft_p50'] * 1000:.0f} ms, "
                  f"p90 {row['ttft_p90'] * 1000:.0f} ms, {row['elapsed']:.1f} s", flush=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": machine_description(), "isa": _core.cpu_isa(), "args": vars(args), "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
