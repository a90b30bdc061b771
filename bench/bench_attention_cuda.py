"""Paged attention on CUDA vs torch SDPA on contiguous K/V of the same shapes.

    python bench/bench_attention_cuda.py [--mode decode|prefill] [--batch 1,16,64]
        [--context 512,2048,8192] [--dtype float16,bfloat16] [--repeats 20] [--out table.md]

decode: one query per sequence (v1/v2 kernels). prefill: whole prompts of `context`
tokens per sequence, causal, through the tiled prefill kernel, against SDPA with the flash
backend (is_causal) when torch can run it for the shape, else whatever SDPA picks (the row
says which). Prints (and optionally writes) a markdown table: median microseconds of each
and the ratio SDPA / vpage (> 1 means the paged kernel is faster despite the
indirection). A case that cannot run (memory, missing backend) becomes a row with the reason.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

from vpage import _ops_cuda

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # torch < 2.3
    SDPBackend = sdpa_kernel = None


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


def _paged_cache(batch, context, dtype, kv_heads, head_size, block_size):
    """Random caches over a shuffled block table: key, value, block_tables, context_lens."""
    dev = torch.device("cuda")
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, kv_heads, head_size // x, block_size, x, device=dev, dtype=dtype)
    value_cache = torch.randn(num_blocks, kv_heads, head_size, block_size, device=dev, dtype=dtype)
    block_tables = torch.randperm(num_blocks, device=dev, dtype=torch.int32).view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    return key_cache, value_cache, block_tables, context_lens


def _case(batch, context, dtype, heads, kv_heads, head_size, block_size, repeats):
    dev = torch.device("cuda")
    key_cache, value_cache, block_tables, context_lens = _paged_cache(batch, context, dtype, kv_heads, head_size,
                                                                      block_size)
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


def _sdpa_prefill(q, k, v, scale, heads, kv_heads):
    """(callable, backend name): flash with GQA if torch allows it for these tensors, else
    flash on expanded K/V, else SDPA's own choice."""
    def causal(qq, kk, vv, **kw):
        return lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, **kw)

    k_full = k.repeat_interleave(heads // kv_heads, dim=1)
    v_full = v.repeat_interleave(heads // kv_heads, dim=1)
    candidates = [("flash, gqa", causal(q, k, v, enable_gqa=True)), ("flash", causal(q, k_full, v_full))]
    if sdpa_kernel is not None:
        for name, fn in candidates:
            try:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    fn()
                torch.cuda.synchronize()
            except (RuntimeError, TypeError):
                continue

            def flash(fn=fn):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    fn()
            return flash, name
    return causal(q, k_full, v_full), "sdpa default"


def _prefill_case(batch, context, dtype, heads, kv_heads, head_size, block_size, repeats):
    dev = torch.device("cuda")
    key_cache, value_cache, block_tables, context_lens = _paged_cache(batch, context, dtype, kv_heads, head_size,
                                                                      block_size)
    query = torch.randn(batch * context, heads, head_size, device=dev, dtype=dtype)
    query_start_loc = torch.arange(0, batch * context + 1, context, dtype=torch.int32, device=dev)
    out = torch.empty_like(query)
    scale = head_size ** -0.5

    def paged():
        _ops_cuda.paged_attention(out, query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
                                  scale, context)

    q = query.view(batch, context, heads, head_size).transpose(1, 2)
    k = torch.randn(batch, kv_heads, context, head_size, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    sdpa, backend = _sdpa_prefill(q, k, v, scale, heads, kv_heads)
    paged_us = _median_us(paged, repeats)
    sdpa_us = _median_us(sdpa, repeats)
    tflops = 4 * batch * heads * head_size * context * (context + 1) / 2 / (paged_us * 1e-6) / 1e12
    return paged_us, sdpa_us, tflops, backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=("decode", "prefill"), default="decode")
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
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; mode {args.mode}, heads {args.heads}, "
        f"kv heads {args.kv_heads}, head size {args.head_size}, block size {args.block_size}, "
        f"{args.repeats} repeats (median)",
        "",
    ]
    if args.mode == "decode":
        lines += ["| dtype | batch | context | vpage paged us | SDPA contiguous us | SDPA / vpage | vpage KV GB/s |",
                  "|---|---|---|---|---|---|---|"]
    else:
        lines += ["| dtype | batch | prompt | vpage tiled us | SDPA us | SDPA / vpage | vpage TFLOP/s | SDPA backend |",
                  "|---|---|---|---|---|---|---|---|"]
    for dtype_name in args.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        for batch in _ints(args.batch):
            for context in _ints(args.context):
                try:
                    if args.mode == "decode":
                        paged_us, sdpa_us, gbps = _case(batch, context, dtype, args.heads, args.kv_heads,
                                                        args.head_size, args.block_size, args.repeats)
                        lines.append(f"| {dtype_name} | {batch} | {context} | {paged_us:.1f} | {sdpa_us:.1f} | "
                                     f"{sdpa_us / paged_us:.2f} | {gbps:.0f} |")
                    else:
                        paged_us, sdpa_us, tflops, backend = _prefill_case(
                            batch, context, dtype, args.heads, args.kv_heads, args.head_size, args.block_size,
                            args.repeats)
                        lines.append(f"| {dtype_name} | {batch} | {context} | {paged_us:.1f} | {sdpa_us:.1f} | "
                                     f"{sdpa_us / paged_us:.2f} | {tflops:.1f} | {backend} |")
                except (RuntimeError, TypeError, ValueError) as err:  # one row, not the whole table
                    reason = str(err).splitlines()[0][:120] if str(err) else type(err).__name__
                    lines.append(f"| {dtype_name} | {batch} | {context} | skipped: {reason} |")
                torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
