"""Quantized-weight matmul on CPU: vpage.ops.quant_matmul on GGUF blocks vs torch float32
matmul (F.linear) on the same weights dequantized, in the same run.

Per block type, weight shape [n, k] (default: the default model's MLP, 1536x576 and
576x1536) and rows m of x: median time, GB/s of weight bytes read (the quantized bytes for
vpage, float32 bytes for torch) and GFLOP/s (2 m n k). For Q4_0, Q4_1, Q8_0 and Q4_K beyond
QUANT_INTEGER_PATH_ROWS rows, both paths are also timed whatever the dispatcher picks: the
integer GEMM (set_quant_integer_gemm_rows(m)) and the float path (set_quant_integer_gemm_rows(0)).
For decode-sized m (<= 16) each timed call runs over --copies distinct weight matrices in turn
(more than the CPU caches hold, as in a model's layers), so the weights come from memory;
larger m use one matrix (compute-bound).
Timing is round-robin (bench_attention.interleaved). Prints the CPU model and instruction set.

    python bench/bench_quant_matmul.py [--types Q4_1,Q8_0] [--m 1,8,64,512] [--repeats 7] [--threads 1]

--decode-model times the integer decode path on the default model's matrices instead (SmolLM2-135M:
per layer Q4_1 qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536; Q8_0 output 49152x576),
each shape cycled over enough copies (at least --decode-bytes) that its weights come from memory,
both as in the file and repacked as the engine runs them (Q4_1x4, Q8_0x4; with VNNI also Q4_1x8, Q8_0x8),
at each m and thread count: us per call, GB/s of weight bytes, cycles per 32-value block per
thread at --ghz (an assumed core clock: the machine has no cycle counter to read), and a token's
total (30 layers plus the output). Calls go straight to the binding (vpage._ops_cpu, as the
engine's trusted path does: no argument checks in Python). The fixed per-call cost (binding,
fork/join on torch's OpenMP threads, x quantization, output store) is the time of a call on a
tiny matrix (n = 64, k = 576: two tasks, so two threads take part; weights in L1), and "block
cost" is what remains per block after subtracting it:

    python bench/bench_quant_matmul.py --decode-model --m 1,2,4 --thread-list 1,2 [--ghz 3.0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench_attention import interleaved, ints, machine_description
from vpage import _core, _ops_cpu, ops

DECODE_ROWS = 16
INTEGER_GEMM_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q4_1x4", "Q8_0x4", "Q4_1x8", "Q8_0x8")  # integer paths beyond 16 rows
FORMATS = {**ops.QUANT_TYPES, **ops.REPACKED_TYPES}


def shapes(text):
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",")]


def random_blocks(qtype, n, k, rng):
    """uint8 [n, row bytes]: random blocks with finite f16 scales (timing only)."""
    if qtype in ops.REPACKED_TYPES:  # rows as the worker repacks them (n a multiple of 4 or 8, k of 64)
        repack = ops.repack_x8 if qtype.endswith("x8") else ops.repack_x4
        return repack(random_blocks(qtype[:-2], n, k, rng), qtype[:-2], n, k)
    _, values, size = ops.QUANT_TYPES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, size=(n, k // values, 2)).astype(np.float16).view(np.uint8)
    if qtype == "Q6_K":
        blocks[:, :, 208:210] = scales[..., :2]
    else:
        blocks[:, :, 0:4] = scales.reshape(n, k // values, 4)
    if qtype == "Q8_0":
        quants = blocks[:, :, 2:]
        quants[quants == 0x80] = 0x81  # no quant of -128, which keeps rows out of Q8_0x4
    return torch.from_numpy(blocks.reshape(n, -1))


def bench_shape(qtype, n, k, ms, args, rng):
    k -= k % FORMATS[qtype][1]  # K types: whole 256-value blocks (576 -> 512)
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

        def forced(rows):  # vpage_run with the integer GEMM up to `rows` rows
            def run():
                _core.set_quant_integer_gemm_rows(rows)
                try:
                    vpage_run()
                finally:
                    _core.set_quant_integer_gemm_rows(_core.QUANT_INTEGER_GEMM_MAX_ROWS)
            return run

        gemm = qtype in INTEGER_GEMM_TYPES and m > _core.QUANT_INTEGER_PATH_ROWS
        runs = [vpage_run, torch_run] + ([forced(m), forced(0)] if gemm else [])
        times = [t / copies for t, _, _ in interleaved(runs, args.repeats, args.clock)]
        tq, tf = times[0], times[1]
        flops = 2 * m * n * k
        paths = ["", "", ""]
        if gemm:
            paths = [f"{flops / times[2] / 1e9:.1f}", f"{flops / times[3] / 1e9:.1f}", f"{times[3] / times[2]:.2f}x"]
        rows.append((qtype, f"{n}x{k}", m, tq * 1e6, qweight.numel() / tq / 1e9, flops / tq / 1e9, *paths,
                     tf * 1e6, dense.numel() * 4 / tf / 1e9, flops / tf / 1e9, tf / tq))
        qs = ws = None  # this m's copies go before the next m's are made
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


MODEL_LAYERS = 30
MODEL_SHAPES = [("Q4_1", 960, 576, MODEL_LAYERS), ("Q4_1", 576, 576, MODEL_LAYERS), ("Q4_1", 3072, 576, MODEL_LAYERS),
                ("Q4_1", 576, 1536, MODEL_LAYERS), ("Q8_0", 49152, 576, 1)]


def bench_decode_model(args, rng):
    """The integer decode path on the default model's shapes (see --decode-model)."""
    print("| threads | m | type | n x k | us/call | GB/s | cycles/block/thread | block cost (cycles) | "
          "calls/token | ms/token |")
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    tiny = random_blocks("Q4_1", 64, 576, rng)
    for threads in args.thread_list:
        ops.set_num_threads(threads)
        for m in args.m:
            x = torch.randn(m, 3072)
            out = torch.empty(m, 49152)
            tiny_out = torch.empty(m, 64)

            x576 = x[:, :576]

            def tiny_run():
                for _ in range(100):
                    _ops_cpu.quant_matmul(tiny_out, x576, tiny, 3, 64, 576)

            fixed_s = interleaved([tiny_run], args.repeats, args.clock)[0][0] / 100
            # Rows as in the file, and as the engine repacks them (x8 where the ISA's kernel reads it).
            total_ms = {"GGUF": 0.0, "x4": 0.0, **({"x8": 0.0} if _core.quant_reads_x8() else {})}
            fixed_ms = 0.0
            for qtype, n, k, calls in MODEL_SHAPES:
                one = random_blocks(qtype, n, k, rng)
                copies = max(1, min(64, -(-args.decode_bytes // one.numel())))
                layouts = [(qtype, ops.QUANT_TYPES[qtype][0], [one.clone() for _ in range(copies)])]
                layouts.append((qtype + "x4", ops.REPACKED_TYPES[qtype + "x4"][0],
                                [ops.repack_x4(q, qtype, n, k) for q in layouts[0][2]]))
                if "x8" in total_ms:
                    layouts.append((qtype + "x8", ops.REPACKED_TYPES[qtype + "x8"][0],
                                    [ops.repack_x8(q, qtype, n, k) for q in layouts[0][2]]))
                xk, outn = x[:, :k], out[:, :n]

                def runner(type_id, qs):
                    def run():
                        for q in qs:
                            _ops_cpu.quant_matmul(outn, xk, q, type_id, n, k)
                    return run

                times = interleaved([runner(type_id, qs) for _, type_id, qs in layouts], args.repeats, args.clock)
                ts = [median / copies for median, *_ in times]
                for layout, t in zip(total_ms, ts):
                    total_ms[layout] += calls * t * 1e3
                for (name, _, _), t in zip(layouts, ts):
                    blocks = n * k // 32
                    cycles = t * args.ghz * 1e9 * threads / blocks
                    block_cost = max(t - fixed_s, 0.0) * args.ghz * 1e9 * threads / blocks
                    print(f"| {threads} | {m} | {name} | {n}x{k} | {t * 1e6:.1f} | {one.numel() / t / 1e9:.2f} | "
                          f"{cycles:.2f} | {block_cost:.2f} | {calls} | {calls * t * 1e3:.2f} |", flush=True)
                fixed_ms += calls * fixed_s * 1e3
                del layouts
            print(f"| {threads} | {m} | fixed | tiny 64x576 | {fixed_s * 1e6:.1f} | | | | | |")
            for layout, ms in total_ms.items():
                print(f"| {threads} | {m} | **token, {layout}** | all | | | | | {4 * MODEL_LAYERS + 1} | "
                      f"**{ms:.2f}** (fixed {fixed_ms:.2f}) |", flush=True)
    ops.set_num_threads(None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default=",".join(FORMATS))
    parser.add_argument("--shapes", type=shapes, default=[(1536, 576), (576, 1536)], help="n x k weights")
    parser.add_argument("--m", type=ints, default=[1, 8, 64, 512])
    parser.add_argument("--copies", type=int, default=64, help="weight matrices cycled for m <= 16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--isa", default="auto", help="auto, avx512vnni, avx512, avx2vnni, avx2 or generic")
    parser.add_argument("--decode-model", action="store_true", help="the default model's decode shapes (see above)")
    parser.add_argument("--thread-list", type=ints, default=[1, 2], help="with --decode-model: thread counts")
    parser.add_argument("--ghz", type=float, default=3.0, help="with --decode-model: assumed core clock")
    parser.add_argument("--decode-bytes", type=int, default=64 << 20,
                        help="with --decode-model: weight bytes cycled per shape (above the caches)")
    args = parse_timing_args(parser)
    _core.set_cpu_isa(args.isa)
    rng = np.random.default_rng(0)
    print(f"CPU: {machine_description()}; vpage ISA: {_core.quant_matmul_isa()}; "
          f"threads: {ops.get_num_threads()}; torch {torch.__version__}; {args.clock_name}")
    if args.decode_model:
        print(f"integer decode path (QUANT_INTEGER_PATH_ROWS = {_core.QUANT_INTEGER_PATH_ROWS}); "
              f"cycles at an assumed {args.ghz} GHz")
        bench_decode_model(args, rng)
        return
    print("| type | n x k | m | vpage us | vpage GB/s | vpage GFLOP/s | integer GEMM GFLOP/s | float path GFLOP/s | "
          "GEMM vs float | torch f32 us | torch GB/s | torch GFLOP/s | vpage vs torch |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for qtype in args.types.split(","):
        for n, k in args.shapes:
            for row in bench_shape(qtype, n, k, args.m, args, rng):
                print("| {} | {} | {} | {:.0f} | {:.2f} | {:.1f} | {} | {} | {} | {:.0f} | {:.2f} | {:.1f} | "
                      "{:.2f}x |".format(*row), flush=True)


if __name__ == "__main__":
    main()
