"""The compute ceiling behind "x% of the machine" for a compute-bound run, and what it allows
on bench_vllm_cpu.py's offline trace:

- ``fma_peak_gflops(threads)``: float32 multiply-adds per second on this machine's cores,
  measured here (fma_peak.c, compiled with the system's C compiler for this CPU);
- ``trace_matmul_flops(n)``: the matmul FLOPs of the default model (SmolLM2-135M) on the first
  n requests of bench_vllm_cpu.py's trace: every prompt and output position through the layers'
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

from bench_throughput import make_trace  # noqa: E402

_SOURCE = Path(__file__).with_name("fma_peak.c")
# SmolLM2-135M: 30 layers of q/o (576 x 576), k/v (192 x 576), gate/up (1536 x 576), down.
LAYERS, HIDDEN, KV, INTERMEDIATE, VOCAB = 30, 576, 192, 1536, 49152


def fma_peak_gflops(threads: int, passes: int = 3) -> float:
    """Best of `passes` runs of fma_peak.c on `threads` threads, GFLOP/s."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "fma_peak")
        subprocess.run([os.environ.get("CC", "cc"), "-O3", "-march=native", "-fopenmp", str(_SOURCE), "-o", binary],
                       check=True)
        out = subprocess.run([binary, str(passes)], capture_output=True, text=True, check=True,
                             env=dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="close")).stdout
    return float(out.split()[0])


def trace_matmul_flops(num_requests: int, seed: int = 0) -> float:
    layer_params = 2 * HIDDEN * HIDDEN + 2 * KV * HIDDEN + 3 * INTERMEDIATE * HIDDEN
    flops = 0.0
    for prompt, output_len in make_trace(num_requests, seed, VOCAB):
        flops += 2 * LAYERS * layer_params * (len(prompt) + output_len - 1) + 2 * VOCAB * HIDDEN * output_len
    return flops


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--num-requests", type=int, default=128)
    args = p.parse_args(argv)
    peak = fma_peak_gflops(args.threads)
    flops = trace_matmul_flops(args.num_requests)
    outputs = sum(n for _, n in make_trace(args.num_requests, 0, VOCAB))
    seconds = flops / (peak * 1e9)
    print(f"float32 FMA peak, {args.threads} threads: {peak:.1f} GFLOP/s")
    print(f"bench_vllm_cpu trace, {args.num_requests} requests: {flops / 1e12:.2f} TFLOP of matmuls, "
          f"{outputs} output tokens: at least {seconds:.0f} s, at most {outputs / seconds:.1f} output tok/s")


if __name__ == "__main__":
    main()
