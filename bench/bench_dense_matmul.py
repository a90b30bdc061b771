"""The packed float matmul (vpage.ops.dense_matmul) against torch's F.linear, in one run.

    python bench/bench_dense_matmul.py                       # the default model's shapes
    python bench/bench_dense_matmul.py --rows 1,64 --shapes 6144x2048,2048x8192 --threads 2

For each (rows m, weight [n, k]) it times torch.nn.functional.linear on float32 and on
bfloat16 weights and activations, and vpage's dense_matmul on packed float32 and bfloat16
weights (float32 activations, and bfloat16 ones), alternating the candidates each repeat, and
prints the median time, GFLOP/s (2 m n k per call) and weight GB/s (the packed weight's bytes
per call: what decode streams), with each vpage column's ratio to torch float32.

    python bench/bench_dense_matmul.py --model-sequence --rows 1,16,64,256,2048

times instead one forward's matmuls of the default model (30 layers of qkv, o, gate_up and
down, each layer its own weights, then the logits) in --dtype, so the weights come from DRAM as
in the engine rather than from a cache that one repeated matmul keeps warm; torch's side is
F.linear in the same dtype (bfloat16: vpage's logits in float32, as the engine asks for them).
--isa LEVEL (any level vpage._core.set_cpu_isa takes, e.g. avx2) times another build of the
kernels on the same CPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from vpage import _core, ops


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_calls(fn, seconds: float) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls


MODEL_LAYERS = 30
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
MODEL_LOGITS = (49152, 576)


def model_sequence(args) -> None:
    """One forward's matmuls of the default model per call, vpage against torch."""
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [[(torch.randn(n, k) / k ** 0.5).to(dtype) for n, k in MODEL_SHAPES] for _ in range(MODEL_LAYERS)]
    logits = (torch.randn(*MODEL_LOGITS) / MODEL_LOGITS[1] ** 0.5).to(dtype)
    packed = [[ops.pack_dense_weight(w) for w in layer] for layer in weights]
    packed_logits = ops.pack_dense_weight(logits)
    print(f"| m | torch {args.dtype} ms | vpage ms | torch GFLOP/s | vpage GFLOP/s | vpage vs torch |")
    print("|---:|---:|---:|---:|---:|---:|")
    for m in (int(v) for v in args.rows.split(",")):
        xs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}
        outs = {n: torch.empty(m, n, dtype=dtype) for n, _ in MODEL_SHAPES}
        outs[MODEL_LOGITS[0]] = torch.empty(m, MODEL_LOGITS[0])
        torch_logits = torch.empty(m, MODEL_LOGITS[0], dtype=dtype)

        def run_torch():
            for layer in weights:
                for w in layer:
                    torch.mm(xs[w.shape[1]], w.t(), out=outs[w.shape[0]])
            torch.mm(xs[576], logits.t(), out=torch_logits)

        def run_vpage():
            for layer in packed:
                for (n, k), w in zip(MODEL_SHAPES, layer):
                    ops.dense_matmul(xs[k], w, n, out=outs[n])
            ops.dense_matmul(xs[576], packed_logits, MODEL_LOGITS[0], out=outs[MODEL_LOGITS[0]],
                             out_dtype=torch.float32)

        flops = 2 * m * (MODEL_LAYERS * sum(n * k for n, k in MODEL_SHAPES) + MODEL_LOGITS[0] * MODEL_LOGITS[1])
        times = {"torch": [], "vpage": []}
        for _ in range(args.repeats):
            times["torch"].append(time_calls(run_torch, args.seconds))
            times["vpage"].append(time_calls(run_vpage, args.seconds))
        t, v = statistics.median(times["torch"]), statistics.median(times["vpage"])
        print(f"| {m} | {1e3 * t:.1f} | {1e3 * v:.1f} | {flops / t / 1e9:.1f} | {flops / v / 1e9:.1f} | "
              f"{t / v:.2f}x |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,64,256,2048")
    p.add_argument("--shapes", default="960x576,3072x576,576x1536,576x576,49152x576",
                   help="weights as NxK (the default model's qkv, gate_up, down, o, logits)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.05, help="per timing")
    p.add_argument("--model-sequence", action="store_true",
                   help="time one forward's matmuls of the default model (weights from DRAM) instead")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="--model-sequence: weights and activations")
    p.add_argument("--isa", default="auto", help="the kernels' instruction set level (vpage._core.set_cpu_isa)")
    args = p.parse_args()
    _core.set_cpu_isa(args.isa)
    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)
    print(f"{cpu_name()}, {args.threads} threads, dense_matmul ISA {_core.dense_matmul_isa()}, "
          f"torch {torch.__version__}\n")
    if args.model_sequence:
        model_sequence(args)
        return
    print("| m | n x k | torch f32 ms | torch bf16 ms | vpage f32 ms | vpage bf16-w ms | vpage bf16 ms | "
          "vpage f32 GFLOP/s | vpage f32 vs torch | bf16-w vs torch f32 | bf16 vs torch bf16 | bf16-w GB/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w32 = torch.randn(n, k) / k ** 0.5
        w16 = w32.bfloat16()
        p32, p16 = ops.pack_dense_weight(w32), ops.pack_dense_weight(w16)
        for m in (int(v) for v in args.rows.split(",")):
            x32 = torch.randn(m, k)
            x16 = x32.bfloat16()
            out32, out16 = torch.empty(m, n), torch.empty(m, n, dtype=torch.bfloat16)
            candidates = {
                "torch f32": lambda: F.linear(x32, w32),
                "torch bf16": lambda: F.linear(x16, w16),
                "vpage f32": lambda: ops.dense_matmul(x32, p32, n, out=out32),
                "vpage bf16-w": lambda: ops.dense_matmul(x32, p16, n, out=out32),
                "vpage bf16": lambda: ops.dense_matmul(x16, p16, n, out=out16),
            }
            times = {name: [] for name in candidates}
            for _ in range(args.repeats):
                for name, fn in candidates.items():
                    times[name].append(time_calls(fn, args.seconds))
            med = {name: statistics.median(t) for name, t in times.items()}
            gflops = 2 * m * n * k / med["vpage f32"] / 1e9
            gbs = p16.numel() * 2 / med["vpage bf16-w"] / 1e9
            print(f"| {m} | {n}x{k} | {1e3 * med['torch f32']:.3f} | {1e3 * med['torch bf16']:.3f} | "
                  f"{1e3 * med['vpage f32']:.3f} | {1e3 * med['vpage bf16-w']:.3f} | {1e3 * med['vpage bf16']:.3f} | "
                  f"{gflops:.1f} | {med['torch f32'] / med['vpage f32']:.2f}x | "
                  f"{med['torch f32'] / med['vpage bf16-w']:.2f}x | {med['torch bf16'] / med['vpage bf16']:.2f}x | "
                  f"{gbs:.1f} |", flush=True)


if __name__ == "__main__":
    main()
