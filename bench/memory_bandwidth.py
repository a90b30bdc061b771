"""The two numbers behind "x% of the weight-streaming limit" for a single decode stream:

- ``read_bandwidth_gbs(threads)``: what this machine's cores read from memory, measured here
  (read_bandwidth.c, compiled with the system's C compiler for this CPU, a 1 GiB buffer);
- ``decode_weight_bytes(gguf)``: the weight bytes one decode step of that file reads: every
  2-D tensor once, except a token embedding that is only looked up (an untied model's:
  ``output.weight`` is the matrix read instead). Norms are counted, too small to matter.

A single stream can run at most read_bandwidth / decode_weight_bytes tokens per second.

    python bench/memory_bandwidth.py [--threads 2] [--model FILE.gguf]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

_SOURCE = Path(__file__).with_name("read_bandwidth.c")


def read_bandwidth_gbs(threads: int, mib: int = 1024, passes: int = 5) -> float:
    """Best of `passes` reads of a `mib` MiB buffer on `threads` threads, GB/s."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "read_bandwidth")
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-march=native", "-fopenmp", str(_SOURCE), "-o", binary],
                       check=True)
        out = subprocess.run([binary, str(mib), str(passes)], capture_output=True, text=True, check=True,
                             env=dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="close")).stdout
    return float(out.split()[0])


def decode_weight_bytes(path: str) -> int:
    """Bytes of the weights one decode token reads from the GGUF file at `path`."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)  # only one row of it is read per token
    return sum(tensors.values())


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--model", default=None, help="GGUF file: also print its bytes per token and the limit")
    args = p.parse_args(argv)
    rate = read_bandwidth_gbs(args.threads)
    print(f"read bandwidth, {args.threads} threads: {rate:.2f} GB/s")
    if args.model:
        weight = decode_weight_bytes(args.model)
        print(f"{os.path.basename(args.model)}: {weight / 1e9:.3f} GB per token, "
              f"at most {rate * 1e9 / weight:.1f} tok/s single stream")


if __name__ == "__main__":
    main()
