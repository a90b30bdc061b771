"""The compute ceiling behind "x% of the machine" for a compute-bound run, and what it allows
on bench_vllm_cpu.py's offline trace:

- ``compute_peaks_gflops(threads)``: float32 multiply-adds per second on this machine's cores,
  and bfloat16 dot products (``vdpbf16ps``) where the CPU has AVX512-BF16, measured here
  (fma_peak.c, compiled with the system's C compiler for this CPU);
- ``trace_matmul_flops(trace)``: the matmul FLOPs of the default model (SmolLM2-135M, the
  shapes of bench_dense_matmul.py's --model-sequence) on bench_vllm_cpu.py's trace: every prompt and output position through the layers'
  projections (except the last output token, which is never fed back), and the logits once
  per output token. Attention adds ~5% and is not counted.

No engine can run that trace faster than trace_matmul_flops / peak seconds (the float32 peak
for float32 weights; for bfloat16 ones the bf16 dot-product peak where there is one).

    python bench/fma_peak.py [--threads 2] [--num-requests 128]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dense_matmul import MODEL_LAYERS, MODEL_LOGITS, MODEL_SHAPES  # noqa: E402
from bench_throughput import make_trace  # noqa: E402

_SOURCE = Path(__file__).with_name("fma_peak.c")


def compute_peaks_gflops(threads: int, passes: int = 3) -> tuple[float, float]:
    """(float32 FMA, bf16 dot product or 0.0): best of `passes` runs of fma_peak.c on `threads`
    threads, GFLOP/s."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "fma_peak")
        subprocess.run([os.environ.get("CC", "cc"), "-O3", "-march=native", "-fopenmp", str(_SOURCE), "-o", binary],
                       check=True)
        out = subprocess.run([binary, str(passes)], capture_output=True, text=True, check=True,
                             env=dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="close")).stdout
    fields = out.split()
    return float(fields[0]), float(fields[3])


def trace_matmul_flops(trace: list[tuple[list[int], int]]) -> float:
    """``trace``: (prompt, output length) pairs, as make_trace gives them."""
    layer_params = sum(n * k for n, k in MODEL_SHAPES)
    logits_params = MODEL_LOGITS[0] * MODEL_LOGITS[1]
    return sum(2 * MODEL_LAYERS * layer_params * (len(prompt) + output_len - 1) + 2 * logits_params * output_len
               for prompt, output_len in trace)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--num-requests", type=int, default=128)
    args = p.parse_args(argv)
    peaks = compute_peaks_gflops(args.threads)
    trace = make_trace(args.num_requests, 0, MODEL_LOGITS[0])
    flops = trace_matmul_flops(trace)
    outputs = sum(n for _, n in trace)
    print(f"bench_vllm_cpu trace, {args.num_requests} requests: {flops / 1e12:.2f} TFLOP of matmuls, "
          f"{outputs} output tokens")
    for name, peak in zip(("float32 FMA", "bf16 dot product (vdpbf16ps)"), peaks):
        if peak <= 0:
            print(f"{name}: not on this CPU")
            continue
        seconds = flops / (peak * 1e9)
        print(f"{name} peak, {args.threads} threads: {peak:.1f} GFLOP/s; the trace's matmuls take at least "
              f"{seconds:.1f} s: at most {outputs / seconds:.1f} output tok/s")


if __name__ == "__main__":
    main()
