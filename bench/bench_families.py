"""Output tok/s of model families against a Llama of the same shape: one GGUF file per
system, each run in its own process, alternating, on the CPU.

    python bench/make_gguf.py qwen3-0.6b --type Q4_1 --out DIR      # and llama-0.6b, ...
    python bench/bench_families.py DIR/llama-0.6b-Q4_1.gguf DIR/qwen3-0.6b-Q4_1.gguf \
        --rounds 3

Two loads per file: one stream (a 32-token prompt, 128 greedy new tokens, decode tok/s after
the first token) and 64 streams (64 requests of 64-token prompts and 64 new tokens each, all
added at once: output tok/s over the whole run). Prints the best of --rounds per file and load,
and each file's ratio to the first file's.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run_worker(path: str, streams: int, threads: int) -> float:
    """One measurement in this process: decode tok/s (one stream) or output tok/s (many)."""
    from vpage import LLM, SamplingParams, ops

    ops.set_num_threads(threads)
    llm = LLM(model=path, device="cpu", kv_cache_memory=2.0, max_model_len=4096, max_num_seqs=max(streams, 1))
    prompt_len, new = (32, 128) if streams == 1 else (64, 64)
    prompts = [[100 + (7 * j + 13 * i) % 9000 for j in range(prompt_len)] for i in range(streams)]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if streams == 1:
        metrics = outputs[0].metrics
        first = metrics.first_token_time - metrics.arrival_time if metrics.first_token_time else 0.0
        return (new - 1) / max(elapsed - first, 1e-9)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", help="GGUF files; the first is the reference")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", default="1,64")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(run_worker(args.worker[0], int(args.worker[1]), args.threads)))
        return
    streams = [int(s) for s in args.streams.split(",")]
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for n in streams:
            for path in args.files:  # alternate systems within each round
                out = subprocess.run([sys.executable, __file__, "--worker", path, str(n), "--threads",
                                      str(args.threads)], check=True, capture_output=True, text=True).stdout
                value = json.loads(out.strip().splitlines()[-1])
                best[(path, n)] = max(best.get((path, n), 0.0), value)
    print(f"CPU: {_cpu_model()}, {args.threads} threads; best of {args.rounds} rounds")
    print("| file | " + " | ".join(f"{n} stream{'s' if n > 1 else ''} tok/s (ratio)" for n in streams) + " |")
    print("|---|" + "---:|" * len(streams))
    for path in args.files:
        cells = [f"{best[(path, n)]:.1f} ({best[(path, n)] / best[(args.files[0], n)]:.2f}x)" for n in streams]
        print(f"| {path.rsplit('/', 1)[-1]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
