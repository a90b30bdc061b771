"""Decode attention: vpage paged kernels vs torch SDPA on contiguous K/V of the same shapes.

    python bench/bench_attention_cuda.py [--batch 1,16,64] [--context 512,2048,8192]
        [--dtype float16,bfloat16] [--repeats 20] [--out table.md]

Prints (and optionally writes) a markdown table: median microseconds of each and the
ratio SDPA / vpage (> 1 means the paged kernel is faster despite the indirection).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

from vpage import _ops_cuda


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _median_us(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    return statistics.median(times)


def _case(batch, context, dtype, heads, kv_heads, head_size, block_size, repeats):
    dev = torch.device("cuda")
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, kv_heads, head_size // x, block_size, x, device=dev, dtype=dtype)
    value_cache = torch.randn(num_blocks, kv_heads, head_size, block_size, device=dev, dtype=dtype)
    block_tables = torch.randperm(num_blocks, device=dev, dtype=torch.int32).view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    query = torch.randn(batch, heads, head_size, device=dev, dtype=dtype)
    out = torch.empty_like(query)
    scale = head_size ** -0.5

    def paged():
        _ops_cuda.paged_attention(out, query, key_cache, value_cache, block_tables, context_lens, None, scale,
                                  context)

    k = torch.randn(batch, kv_heads, context, head_size, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    q = query.unsqueeze(2)
    try:
        F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

        def sdpa():
            F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    except TypeError:  # torch < 2.5: expand the KV heads outside the timed region
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)

        def sdpa():
            F.scaled_dot_product_attention(q, k, v, scale=scale)

    paged_us = _median_us(paged, repeats)
    sdpa_us = _median_us(sdpa, repeats)
    kv_gbps = 2 * batch * context * kv_heads * head_size * key_cache.element_size() / (paged_us * 1e-6) / 1e9
    return paged_us, sdpa_us, kv_gbps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("--context", default="512,2048,8192")
    parser.add_argument("--dtype", default="float16,bfloat16")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    lines = [
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; heads {args.heads}, "
        f"kv heads {args.kv_heads}, head size {args.head_size}, block size {args.block_size}, "
        f"{args.repeats} repeats (median)",
        "",
        "| dtype | batch | context | vpage paged us | SDPA contiguous us | SDPA / vpage | vpage KV GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        for batch in _ints(args.batch):
            for context in _ints(args.context):
                paged_us, sdpa_us, gbps = _case(batch, context, dtype, args.heads, args.kv_heads, args.head_size,
                                                args.block_size, args.repeats)
                lines.append(f"| {dtype_name} | {batch} | {context} | {paged_us:.1f} | {sdpa_us:.1f} | "
                             f"{sdpa_us / paged_us:.2f} | {gbps:.0f} |")
                torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
