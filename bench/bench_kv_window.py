"""KV blocks one long request holds with a sliding window, against no window: the real C++
scheduler (through its binding) runs one request (prompt --prompt tokens, --new generated
tokens, chunked prefill of --chunk tokens per step) and the most GPU blocks in use at once is
recorded after every schedule (before commit frees any). Bytes use Mistral-7B's KV shape (32
layers, 8 KV heads, head size 128, 16-bit cache); the forward is not run, so no model is needed.

    python bench/bench_kv_window.py                       # Mistral-7B-v0.1: window 4096, 7k + 1k
    python bench/bench_kv_window.py --window 4096,8192 --repeat 5 --markdown

Besides the peak it reports the scheduler's schedule + commit time per step (median and
p10-p90 over --repeat runs of the whole request), windowed against not, from the same run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time

import numpy as np

from vpage import _core

LAYERS, KV_HEADS, HEAD_SIZE, DTYPE_BYTES = 32, 8, 128, 2  # Mistral-7B, float16/bfloat16 cache


def block_bytes(block_size: int) -> int:
    """Bytes of one block over every layer: keys and values."""
    return 2 * LAYERS * KV_HEADS * HEAD_SIZE * block_size * DTYPE_BYTES


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def run_request(window: int, args) -> tuple[int, int, list[float]]:
    """(peak blocks in use, steps, per-step schedule + commit seconds) of one request."""
    blocks_needed = -(-(args.prompt + args.new) // args.block_size)
    # (sliding_window only when set: the no-window row also runs on a vpage without it.)
    blocks = _core.BlockManagerConfig(block_size=args.block_size, num_gpu_blocks=blocks_needed + 64,
                                      num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=True)
    if window:
        blocks.sliding_window = window
    scheduler = _core.Scheduler(
        _core.SchedulerConfig(max_num_batched_tokens=args.chunk, max_num_seqs=1, max_model_len=args.prompt + args.new,
                              enable_chunked_prefill=True), blocks)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 32000, args.prompt)]
    stop = _core.StopConditions(max_tokens=args.new, eos_token_ids=[2], ignore_eos=True)
    scheduler.add_sequence_group("long", prompt, 1, stop, 0.0)
    peak, times = 0, []
    token = np.array([7], dtype=np.int32)
    while scheduler.has_unfinished():
        start = time.perf_counter()
        plan = scheduler.schedule()
        usage = scheduler.usage()  # read between the two calls; not part of the step's time
        mid = time.perf_counter()
        peak = max(peak, usage.num_gpu_blocks - usage.free_gpu_blocks)
        ids = np.asarray(plan.sample_seq_ids, dtype=np.int64)
        resumed = time.perf_counter()
        scheduler.commit(ids, token[:len(ids)])
        times.append((mid - start) + (time.perf_counter() - resumed))
    return peak, len(times), times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", default="4096",
                        help="comma-separated windows (no window is always run; '0': only that one)")
    parser.add_argument("--prompt", type=int, default=7 * 1024)
    parser.add_argument("--new", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (prefill chunk)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args()
    windows = [0] + [int(w) for w in args.window.split(",") if int(w) > 0]
    print(f"# {cpu_name()}; python {platform.python_version()}; vpage scheduler only (no forward)")
    print(f"# request: prompt {args.prompt} + {args.new} new tokens, chunked prefill {args.chunk}, "
          f"block size {args.block_size}, prefix caching on; KV bytes for 32 layers x 8 KV heads x 128 x "
          f"{DTYPE_BYTES} B ({block_bytes(args.block_size) / 2**20:.0f} MiB per block)")
    rows = []
    for window in windows:
        runs = [run_request(window, args) for _ in range(args.repeat)]
        peak, steps = runs[0][0], runs[0][1]
        assert all(r[0] == peak and r[1] == steps for r in runs)  # the scheduler is deterministic
        per_step = sorted(statistics.median(r[2]) for r in runs)
        all_steps = np.array([t for r in runs for t in r[2]])
        bound = -(-(window - 1 + args.chunk) // args.block_size) + 1 if window else None
        rows.append((window, peak, bound, steps, statistics.median(per_step) * 1e6,
                     np.percentile(all_steps, 10) * 1e6, np.percentile(all_steps, 90) * 1e6))
    full = rows[0][1]
    if args.markdown:
        print("| window | peak KV blocks | bound | peak KV memory (MiB) | vs no window | steps | "
              "schedule+commit median (µs) | p10–p90 (µs) |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for window, peak, bound, steps, median, p10, p90 in rows:
        mib = peak * block_bytes(args.block_size) / 2**20
        if args.markdown:
            print(f"| {window or 'none'} | {peak} | {bound or '—'} | {mib:.0f} | {peak / full:.2f} | {steps} | "
                  f"{median:.1f} | {p10:.1f}–{p90:.1f} |")
        else:
            print(f"window {window or 'none':>5}: peak {peak} blocks ({mib:.0f} MiB, {peak / full:.2f} of no window"
                  f"{f'; bound {bound}' if bound else ''}), {steps} steps, schedule+commit median {median:.1f} µs "
                  f"(p10-p90 {p10:.1f}-{p90:.1f})")


if __name__ == "__main__":
    main()
