"""Paged decode attention on CPU: vpage vs torch SDPA, in the same run.

Compares, per (dtype, batch, context):
  * vpage   : vpage.ops.paged_attention over a shuffled block table (block size 16);
  * sdpa    : torch scaled_dot_product_attention on contiguous K/V [batch, kv_heads, ctx, hs]
              (the faster of enable_gqa=True and K/V expanded to all heads);
  * gather  : gather K/V through the block table into contiguous tensors, then SDPA.
All four are timed round-robin, so load changes on a shared machine hit them alike, and
the order rotates every repeat, so no variant always runs right after the same other one
(torch's OpenMP workers keep spinning for a while after an op, taking a core from the
next one). Prints a markdown table with medians (vpage also p10-p90), ratios, KV bytes
read per second and its fraction of the machine's copy bandwidth (torch copy of a 512 MiB
buffer, read + write bytes).

    python bench/bench_attention.py [--batch 32,64] [--context 512,2048] [--repeats 20]

``--vpage-only --clock thread --threads 1`` times vpage alone with CPU time (kernel A/B on a
shared machine: run it once per build, alternating, and compare medians).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from vpage import _core, ops


def ints(text):
    return [int(v) for v in text.split(",")]


def quantile(sorted_samples, q):
    return sorted_samples[round(q * (len(sorted_samples) - 1))]


def timed(fn, repeats):
    """(median, p10, p90) of `repeats` timed calls after one warm-up call."""
    return interleaved([fn], repeats)[0]


def interleaved(fns, repeats, clock=time.perf_counter):
    """Times the functions round-robin, starting one function later every repeat (so load
    changes on a shared machine hit all of them alike, and each follows every other one
    equally often); returns (median, p10, p90) per function. ``clock=time.thread_time``
    measures CPU time instead (single-threaded runs on a machine shared with others)."""
    for fn in fns:
        fn()
    samples = [[] for _ in fns]
    for r in range(repeats):
        for k in range(len(fns)):
            i = (r + k) % len(fns)
            start = clock()
            fns[i]()
            samples[i].append(clock() - start)
    result = []
    for s in samples:
        s = sorted(s)
        result.append((statistics.median(s), quantile(s, 0.1), quantile(s, 0.9)))
    return result


def machine_description():
    """CPU model and logical CPU count (Linux /proc/cpuinfo, else platform)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical CPUs"


def copy_bandwidth(repeats):
    src = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    dst = torch.empty_like(src)
    median, _, _ = timed(lambda: dst.copy_(src), max(3, repeats // 4))
    return 2 * src.numel() * 4 / median


def bench_case(dtype, batch, context, args):
    heads, kv_heads, head_size, block_size = args.heads, args.kv_heads, args.head_size, args.block_size
    blocks_per_seq = (context + block_size - 1) // block_size
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.randn(ops.key_cache_shape(num_blocks, kv_heads, head_size, block_size, dtype),
                            generator=gen).to(dtype)
    value_cache = torch.randn(ops.value_cache_shape(num_blocks, kv_heads, head_size, block_size, dtype),
                              generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).reshape(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn((batch, heads, head_size), generator=gen).to(dtype)
    out = torch.empty_like(query)
    scale = 1 / math.sqrt(head_size)

    k = torch.randn((batch, kv_heads, context, head_size), generator=gen).to(dtype)
    v = torch.randn((batch, kv_heads, context, head_size), generator=gen).to(dtype)
    q4 = query.unsqueeze(2)
    group = heads // kv_heads

    def sdpa_gqa():
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    k_full = k.repeat_interleave(group, dim=1)
    v_full = v.repeat_interleave(group, dim=1)

    def sdpa_expanded():
        return F.scaled_dot_product_attention(q4, k_full, v_full, scale=scale)

    def gather_sdpa():
        ids = tables.long()
        padded = blocks_per_seq * block_size
        kg = key_cache[ids].permute(0, 2, 1, 4, 3, 5).reshape(batch, kv_heads, padded, head_size)[:, :, :context]
        vg = value_cache[ids].permute(0, 2, 1, 4, 3).reshape(batch, kv_heads, padded, head_size)[:, :, :context]
        return F.scaled_dot_product_attention(q4, kg, vg, scale=scale, enable_gqa=True)

    def vpage_decode():
        return ops.paged_attention(query, key_cache, value_cache, tables, lens, scale, context, out=out)

    kv_bytes = 2 * batch * kv_heads * context * head_size * query.element_size()
    if args.vpage_only:
        inner = max(1, 20000 // (batch * context))  # calls per sample: short calls > clock resolution

        def vpage_many():
            for _ in range(inner):
                vpage_decode()

        (t, p10, p90), = interleaved([vpage_many], args.repeats, clock=CLOCKS[args.clock])
        return dict(vpage=t / inner, p10=p10 / inner, p90=p90 / inner, rate=kv_bytes * inner / t)

    (vpage_t, vpage_p10, vpage_p90), (gqa_t, _, _), (expanded_t, _, _), (gather_t, _, _) = interleaved(
        [vpage_decode, sdpa_gqa, sdpa_expanded, gather_sdpa], args.repeats)
    sdpa_t = min(gqa_t, expanded_t)
    return dict(vpage=vpage_t, p10=vpage_p10, p90=vpage_p90, sdpa=sdpa_t,
                sdpa_kind="gqa" if gqa_t <= expanded_t else "expanded", gather=gather_t,
                rate=kv_bytes / vpage_t)


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=ints, default=[32, 64])
    parser.add_argument("--context", type=ints, default=[512, 2048])
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--thread-source", choices=["openmp", "own"], default="openmp",
                        help="vpage's kernel threads: torch's OpenMP threads (default) or vpage's own pool")
    parser.add_argument("--vpage-only", action="store_true", help="time vpage alone (no SDPA, no gather)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time (default) or this thread's CPU time (for --vpage-only --threads 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)
    runtime = ops.set_thread_source(args.thread_source)
    bandwidth = copy_bandwidth(args.repeats)
    print(f"machine: {machine_description()}; threads {args.threads}, "
          f"torch {torch.__version__}, vpage isa {_core.cpu_isa()}, vpage threads {runtime or 'own pool'}")
    print(f"shapes: heads {args.heads}, kv heads {args.kv_heads}, head size {args.head_size}, "
          f"block size {args.block_size}; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)\n")
    if args.vpage_only:
        print(f"| dtype | batch | context | vpage us (p10-p90), {args.clock} clock | KV read GB/s |")
        print("|---|---|---|---|---|")
        for name in args.dtype.split(","):
            for batch in args.batch:
                for context in args.context:
                    r = bench_case(getattr(torch, name), batch, context, args)
                    print(f"| {name} | {batch} | {context} | {r['vpage'] * 1e6:.1f} ({r['p10'] * 1e6:.1f}-"
                          f"{r['p90'] * 1e6:.1f}) | {r['rate'] / 1e9:.1f} |", flush=True)
        return
    print("| dtype | batch | context | vpage ms (p10-p90) | SDPA contiguous ms | gather+SDPA ms "
          "| SDPA / vpage | gather / vpage | KV read GB/s | of copy bw |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.dtype.split(","):
        dtype = getattr(torch, name)
        for batch in args.batch:
            for context in args.context:
                r = bench_case(dtype, batch, context, args)
                print(f"| {name} | {batch} | {context} | {r['vpage'] * 1e3:.2f} ({r['p10'] * 1e3:.2f}-{r['p90'] * 1e3:.2f}) "
                      f"| {r['sdpa'] * 1e3:.2f} ({r['sdpa_kind']}) | {r['gather'] * 1e3:.2f} "
                      f"| {r['sdpa'] / r['vpage']:.2f} | {r['gather'] / r['vpage']:.2f} "
                      f"| {r['rate'] / 1e9:.1f} | {r['rate'] / bandwidth:.0%} |", flush=True)


if __name__ == "__main__":
    main()
