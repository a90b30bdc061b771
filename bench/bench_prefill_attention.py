"""Paged prefill attention on CPU: vpage vs torch SDPA causal on contiguous K/V, same run.

Per (dtype, case), where a case is seqs x prompt tokens (query = whole context) or a
chunk of query tokens after a cached prefix:
  * vpage : vpage.ops.paged_prefill_attention over a shuffled block table (block size 16);
  * sdpa  : torch scaled_dot_product_attention(is_causal, enable_gqa) per sequence batch on
            contiguous K/V [seqs, kv_heads, ctx, hs] (for a chunk after a prefix, an
            explicit bottom-right causal mask, since is_causal is top-left aligned).
Both are timed round-robin (order rotating every repeat), so load from other processes
hits them alike. Prints a markdown table of medians.

    python bench/bench_prefill_attention.py [--threads 2] [--repeats 15]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench_attention import interleaved  # this folder's decode benchmark: round-robin timer
from vpage import _core, ops

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK = 9, 3, 64, 16
# (label, seqs, query tokens per seq, context tokens per seq)
CASES = [("13x160", 13, 160, 160), ("4x512", 4, 512, 512), ("32x64", 32, 64, 64),
         ("1x256 after 768", 1, 256, 1024)]


def make_case(seqs, queries, ctx, dtype, gen):
    blocks_per_seq = (ctx + BLOCK - 1) // BLOCK
    num_blocks = seqs * blocks_per_seq
    k = torch.randn(seqs, ctx, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    v = torch.randn(seqs, ctx, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    q = torch.randn(seqs * queries, NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    kc = torch.zeros(ops.key_cache_shape(num_blocks, NUM_KV_HEADS, HEAD_SIZE, BLOCK, dtype), dtype=dtype)
    vc = torch.zeros(ops.value_cache_shape(num_blocks, NUM_KV_HEADS, HEAD_SIZE, BLOCK, dtype), dtype=dtype)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(seqs, blocks_per_seq)
    slots = torch.stack([tables[s].repeat_interleave(BLOCK)[:ctx].long() * BLOCK + torch.arange(ctx) % BLOCK
                         for s in range(seqs)])
    ops.reshape_and_cache(k.reshape(-1, NUM_KV_HEADS, HEAD_SIZE), v.reshape(-1, NUM_KV_HEADS, HEAD_SIZE),
                          kc, vc, slots.reshape(-1))
    starts = torch.arange(seqs + 1, dtype=torch.int32) * queries
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    out = torch.empty_like(q)
    scale = HEAD_SIZE ** -0.5

    def vpage():
        ops.paged_prefill_attention(q, kc, vc, tables, starts, lens, scale, max_context_len=ctx, out=out)

    kt = k.permute(0, 2, 1, 3).contiguous()
    vt = v.permute(0, 2, 1, 3).contiguous()
    qt = q.view(seqs, queries, NUM_HEADS, HEAD_SIZE).permute(0, 2, 1, 3).contiguous()
    mask = None
    if queries != ctx:
        pos = torch.arange(ctx)
        mask = pos[None, :] <= (ctx - queries + torch.arange(queries))[:, None]

    def sdpa():
        if mask is None:
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True, scale=scale)
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True, scale=scale)

    # Same answer (loose bound: bf16 rounding).
    vpage()
    ref = sdpa().permute(0, 2, 1, 3).reshape(q.shape).float()
    err = (out.float() - ref).abs().max().item()
    assert err < (2e-2 if dtype != torch.float32 else 1e-4), err
    return vpage, sdpa


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"vpage ISA {_core.cpu_isa()}, torch {torch.__version__}, {args.threads} threads, "
          f"{NUM_HEADS} q heads / {NUM_KV_HEADS} kv heads, head size {HEAD_SIZE}, block {BLOCK}, "
          f"median of {args.repeats}\n")
    print("| dtype | case | vpage ms | sdpa ms | vpage/sdpa | vpage GFLOP/s |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        for label, seqs, queries, ctx in CASES:
            vp, sd = make_case(seqs, queries, ctx, dtype, gen)
            (t_vp, _, _), (t_sd, _, _) = interleaved([vp, sd], args.repeats)
            # causal QK + PV multiply-adds actually needed: sum over queries of visible keys
            visible = sum(ctx - queries + i + 1 for i in range(queries))
            flops = 4 * seqs * NUM_HEADS * HEAD_SIZE * visible
            print(f"| {str(dtype).replace('torch.', '')} | {label} | {t_vp * 1e3:.2f} | {t_sd * 1e3:.2f} | "
                  f"{t_vp / t_sd:.2f} | {flops / t_vp / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
