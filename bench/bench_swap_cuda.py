"""Swap bandwidth of the engine's CacheEngine on CUDA (pinned swap pool, cache stream).

    python bench/bench_swap_cuda.py --blocks 16,64,256 --repeats 10 --out swap.md

One CacheEngine with the default model's layout (every layer's key and value cache, the
block size and dtype below). For each count N, one step's swap moves N blocks of every
layer: contiguous block ids (runs merged into one copy per layer and cache) and scattered
ids (one copy per block). Bytes per swap = N x bytes_per_block (all layers); GB/s over the
wall time from issue to the cache stream's completion; median of --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from vpage.worker.cache_engine import CacheEngine, bytes_per_block
from vpage.model_executor.loader.model_loader import load_model


def timed_swap(cache: CacheEngine, out_pairs: np.ndarray, in_pairs: np.ndarray, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache.swap(out_pairs, in_pairs)
        cache.wait_for_swaps()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default="16,64,256")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = load_model(None, args.dtype, "cpu", "none").config
    counts = [int(n) for n in args.blocks.split(",")]
    pool = 2 * max(counts)
    cache = CacheEngine(config, args.block_size, pool, pool, torch.device("cuda"))
    block_bytes = bytes_per_block(config, args.block_size)
    rng = np.random.default_rng(0)
    lines = [f"{torch.cuda.get_device_name()}, {config.architecture} layout ({config.num_layers} layers), "
             f"{args.dtype}, block size {args.block_size}: {block_bytes / 1024:.0f} KiB per block (all layers); "
             f"median of {args.repeats}", "",
             "| blocks | MB per swap | ids | out GB/s | in GB/s |", "|---:|---:|---|---:|---:|"]
    for n in counts:
        for kind in ("contiguous", "scattered"):
            ids = np.arange(n) if kind == "contiguous" else np.sort(rng.choice(pool, n, replace=False))[::-1].copy()
            pairs = np.stack([ids, np.arange(n)], axis=1).astype(np.int64)
            empty = np.zeros((0, 2), np.int64)
            t_out = timed_swap(cache, pairs, empty, args.repeats)
            t_in = timed_swap(cache, empty, pairs[:, ::-1].copy(), args.repeats)
            size = n * block_bytes
            lines.append(f"| {n} | {size / 1e6:.1f} | {kind} | {size / t_out / 1e9:.1f} | {size / t_in / 1e9:.1f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
