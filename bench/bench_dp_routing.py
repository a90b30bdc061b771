"""Data-parallel routing: prefix-aware against round-robin, on one multi-turn chat trace.

    python bench/bench_dp_routing.py [--dp 4] [--conversations 48] [--turns 3] [--concurrency 16]
        [--system-prompts 16] [--system-words 300] [--kv-cache-memory 0.3] [--rounds 1] [--model M]

One `vpage serve --data-parallel-size DP` per policy (``--data-parallel-routing prefix`` and
``round_robin``), the same seeded trace sent to each: ``--conversations`` conversations, each
under one of ``--system-prompts`` long system prompts (random common words, about one token
each), of ``--turns`` turns; turn k's prompt is the system prompt, the earlier turns (the user's
messages and the model's replies as it wrote them) and a new user message. Conversations run
``--concurrency`` at a time, each one's turns in order; every reply is streamed, greedy,
``--max-tokens`` long. Reported per policy: the prefix-cache hit rate over the run (the prompt
tokens served from a replica's cache, ``usage.prompt_tokens_details.cached_tokens``, over all
prompt tokens), TTFT p50/p90, end-to-end time, and the ratios prefix / round-robin.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

_WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
          "word but not what all were we when your can said there use an each which she do how their if will up "
          "other about out many then them these so some her would make like him into time has look two more write "
          "go see number no way could people my than first water been call who oil its now find long down day did "
          "get come made may part").split()
_SERVING = re.compile(rb"serving \S+ on http://127\.0\.0\.1:(\d+)/v1")


def make_trace(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(system prompt, user messages) per conversation, seeded."""
    rng = random.Random(args.seed)
    systems = [" ".join(rng.choice(_WORDS) for _ in range(args.system_words)) for _ in range(args.system_prompts)]
    return [(rng.choice(systems), [" ".join(rng.choice(_WORDS) for _ in range(args.user_words))
                                   for _ in range(args.turns)]) for _ in range(args.conversations)]


def start_server(args: argparse.Namespace, flags: list[str], log_path: str) -> tuple[subprocess.Popen, int]:
    """One `vpage serve` on a free port with ``flags`` added: (process, port)."""
    cmd = [sys.executable, "-m", "vpage.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--kv-cache-memory", str(args.kv_cache_memory), "--max-model-len", "2048", *flags]
    if args.model:
        cmd += ["--model", args.model]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    for line in proc.stdout:
        log.write(line)
        match = _SERVING.search(line)
        if match:
            # Keep draining the server's output so that it never blocks on a full pipe.
            ThreadPoolExecutor(1).submit(lambda: [log.write(chunk) for chunk in proc.stdout])
            return proc, int(match.group(1))
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"the server did not start; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains and exits: queued disk writes finish), SIGKILL after 60 s."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def complete(port: int, prompt: str, max_tokens: int) -> tuple[float, str, dict]:
    """(TTFT in s, reply text, usage) of one streamed greedy completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft, parts, usage = None, [], {}
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        event = json.loads(line[5:])
        usage = event.get("usage") or usage
        text = "".join(c.get("text") or "" for c in event.get("choices") or [])
        if text and ttft is None:
            ttft = time.perf_counter() - start
        parts.append(text)
    conn.close()
    return ttft if ttft is not None else float("nan"), "".join(parts), usage


def run_policy(args: argparse.Namespace, routing: str, trace, log_path: str) -> dict:
    proc, port = start_server(args, ["--data-parallel-size", str(args.dp), "--data-parallel-routing", routing],
                              log_path)
    try:
        complete(port, "warm up", 2)
        ttfts: list[float] = []
        tokens = {"prompt": 0, "cached": 0}

        def conversation(system: str, messages: list[str]) -> None:
            history = system
            for message in messages:
                history += f"\nUser: {message}\nAssistant:"
                ttft, reply, usage = complete(port, history, args.max_tokens)
                ttfts.append(ttft)
                tokens["prompt"] += usage["prompt_tokens"]
                tokens["cached"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                history += reply

        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            for future in [pool.submit(conversation, s, m) for s, m in trace]:
                future.result()
        elapsed = time.perf_counter() - start
    finally:
        stop_server(proc)
    ttfts.sort()
    return {"routing": routing, "hit_rate": tokens["cached"] / max(1, tokens["prompt"]),
            "ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "elapsed": elapsed, "requests": len(ttfts)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--model", default=None, help="default: vpage's default model")
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--system-prompts", type=int, default=16)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--user-words", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-memory", type=float, default=0.3, help="GiB per replica")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default="bench-dp-logs")
    args = parser.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    trace = make_trace(args)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs; dp {args.dp}; "
          f"{args.conversations} conversations x {args.turns} turns under {args.system_prompts} system prompts of "
          f"{args.system_words} words, {args.concurrency} at a time, {args.max_tokens} tokens per reply; KV cache "
          f"{args.kv_cache_memory} GiB per replica", flush=True)
    rows = []
    for r in range(args.rounds):
        for routing in ("round_robin", "prefix") if r % 2 == 0 else ("prefix", "round_robin"):
            row = run_policy(args, routing, trace, os.path.join(args.log_dir, f"{routing}-r{r + 1}.log"))
            row["round"] = r + 1
            rows.append(row)
            print(f"  round {r + 1} {routing}: hit rate {row['hit_rate']:.3f}, TTFT p50 {row['ttft_p50'] * 1000:.0f} ms, "
                  f"p90 {row['ttft_p90'] * 1000:.0f} ms, {row['elapsed']:.1f} s", flush=True)
    print("\n| round | routing | requests | prefix-cache hit rate | TTFT p50 ms | TTFT p90 ms | elapsed s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['round']} | {row['routing']} | {row['requests']} | {row['hit_rate']:.3f} | "
              f"{row['ttft_p50'] * 1000:.0f} | {row['ttft_p90'] * 1000:.0f} | {row['elapsed']:.1f} |")
    for r in range(1, args.rounds + 1):
        by = {row["routing"]: row for row in rows if row["round"] == r}
        p, rr = by["prefix"], by["round_robin"]
        print(f"round {r}: hit rate prefix / round-robin {p['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x, "
              f"TTFT p50 {p['ttft_p50'] / rr['ttft_p50']:.2f}x, elapsed {p['elapsed'] / rr['elapsed']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
