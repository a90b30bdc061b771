"""The compute ceiling behind "x% of the machine" for a compute-bound run, and what it allows
on bench_vllm_cpu.py's offline trace:

- ``fma_peak_gflops(threads)``: float32 multiply-adds per second on this machine's cores,
  measured here (fma_peak.c, compiled with the system's C compiler for this CPU);
- ``trace_matmul_flops(trace)``: the matmul FLOPs of the default model (SmolLM2-135M, the
  shapes of bench_dense_matmul.py's --model-sequence) on bench_vllm_cpu.py's trace: every prompt and output position through the layers'
  projections (except the last output token, which is never fed back), and the logits once
  per output token. Attention adds ~5% and is not counted.

No engine can run that trace faster than trace_matmul_flops / fma_peak seconds.

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


def fma_peak_gflops(threads: int, passes: int = 3) -> float:
    """Best of `passes` runs of fma_peak.c on `threads` threads, GFLOP/s."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "fma_peak")
        subprocess.run([os.environ.get("CC", "cc"), "-O3", "-march=native", "-fopenmp", str(_SOURCE), "-o", binary],
                       check=True)
        out = subprocess.run([binary, str(passes)], capture_output=True, text=True, check=True,
                             env=dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="close")).stdout
    return float(out.split()[0])


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
    peak = fma_peak_gflops(args.threads)
    trace = make_trace(args.num_requests, 0, MODEL_LOGITS[0])
    flops = trace_matmul_flops(trace)
    outputs = sum(n for _, n in trace)
    seconds = flops / (peak * 1e9)
    print(f"float32 FMA peak, {args.threads} threads: {peak:.1f} GFLOP/s")
    print(f"bench_vllm_cpu trace, {args.num_requests} requests: {flops / 1e12:.2f} TFLOP of matmuls, "
          f"{outputs} output tokens: at least {seconds:.0f} s, at most {outputs / seconds:.1f} output tok/s")


if __name__ == "__main__":
    main()
