"""Quantized-weight matmul on CPU: vpage.ops.quant_matmul on GGUF blocks vs torch float32
matmul (F.linear) on the same weights dequantized, in the same run.

Per block type, weight shape [n, k] (default: the default model's MLP, 1536x576 and
576x1536) and rows m of x: median time, GB/s of weight bytes read (the quantized bytes for
vpage, float32 bytes for torch) and GFLOP/s (2 m n k). For decode-sized m (<= 16) each timed
call runs over --copies distinct weight matrices in turn (more than the CPU caches hold, as
in a model's layers), so the weights come from memory; larger m use one matrix (compute-bound).
Timing is round-robin (bench_attention.interleaved). Prints the CPU model and instruction set.

    python bench/bench_quant_matmul.py [--types Q4_1,Q8_0] [--m 1,8,64,512] [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from bench_attention import interleaved, ints, machine_description
from vpage import _core, ops

DECODE_ROWS = 16


def shapes(text):
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]


def random_blocks(qtype, n, k, rng):
    """uint8 [n, row bytes]: random blocks with finite f16 scales (timing only)."""
    _, values, size = ops.QUANT_TYPES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, size=(n, k // values, 2)).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":
        blocks[:, :, 208:210] = scales[..., :2]
    else:
        blocks[:, :, 0:4] = scales.reshape(n, k // values, 4)
    return torch.from_numpy(blocks.reshape(n, -1))


def bench_shape(qtype, n, k, ms, args, rng):
    k -= k % ops.QUANT_TYPES[qtype][1]  # K types: whole 256-value blocks (576 -> 512)
    qweight = random_blocks(qtype, n, k, rng)
    dense = ops.dequantize_rows(qweight, qtype, k)
    rows = []
    for m in ms:
        copies = args.copies if m <= DECODE_ROWS else 1
        qs = [qweight.clone() for _ in range(copies)]
        ws = [dense.clone() for _ in range(copies)]
        x = torch.randn(m, k)
        out_q, out_f = torch.empty(m, n), torch.empty(m, n)

        def vpage_run():
            for q in qs:
                ops.quant_matmul(x, q, qtype, n, k, out=out_q)

        def torch_run():
            for w in ws:
                torch.matmul(x, w.t(), out=out_f)

        (tq, _, _), (tf, _, _) = interleaved([vpage_run, torch_run], args.repeats, args.clock)
        tq, tf = tq / copies, tf / copies
        flops = 2 * m * n * k
        rows.append((qtype, f"{n}x{k}", m, tq * 1e6, qweight.numel() / tq / 1e9, flops / tq / 1e9,
                     tf * 1e6, dense.numel() * 4 / tf / 1e9, flops / tf / 1e9, tf / tq))
        del qs, ws
    return rows


def parse_timing_args(parser):
    """Adds --threads and --cpu-time to ``parser``, parses, sets torch's threads, and returns
    the arguments with ``clock`` (the timer for ``interleaved``) and ``clock_name``."""
    parser.add_argument("--threads", type=int, default=None, help="threads of both (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="with --threads 1: time by thread CPU time (robust on a shared machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time needs --threads 1")
    args.clock = time.thread_time if args.cpu_time else time.perf_counter
    args.clock_name = "thread CPU time" if args.cpu_time else "wall time"
    return args


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default=",".join(ops.QUANT_TYPES))
    parser.add_argument("--shapes", type=shapes, default=[(1536, 576), (576, 1536)], help="n x k weights")
    parser.add_argument("--m", type=ints, default=[1, 8, 64, 512])
    parser.add_argument("--copies", type=int, default=64, help="weight matrices cycled for m <= 16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--isa", default="auto", help="auto, avx512, avx2 or generic")
    args = parse_timing_args(parser)
    _core.set_cpu_isa(args.isa)
    rng = np.random.default_rng(0)
    print(f"CPU: {machine_description()}; vpage ISA: {_core.quant_matmul_isa()}; "
          f"threads: {ops.get_num_threads()}; torch {torch.__version__}; {args.clock_name}")
    print("| type | n x k | m | vpage us | vpage GB/s | vpage GFLOP/s | torch f32 us | torch GB/s | "
          "torch GFLOP/s | speed-up |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for qtype in args.types.split(","):
        for n, k in args.shapes:
            for row in bench_shape(qtype, n, k, args.m, args, rng):
                print("| {} | {} | {} | {:.0f} | {:.2f} | {:.1f} | {:.0f} | {:.2f} | {:.1f} | {:.2f}x |".format(*row),
                      flush=True)


if __name__ == "__main__":
    main()
