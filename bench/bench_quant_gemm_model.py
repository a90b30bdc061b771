"""The integer GEMM path (Q4_0/Q4_1/Q8_0 beyond QUANT_INTEGER_PATH_ROWS rows) in the whole
default model (SmolLM2-135M: Q4_1 matrices, Q8_0 output), against the float path it replaces,
in one process, configurations alternating per repeat (each call's prompts are fresh random
tokens, so the prefix cache never hits):

- prefill: --prompts prompts of --prompt-len random tokens, max_tokens=1; prompt tokens/s
  (prefill batches of max_num_batched_tokens = 2048 rows);
- decode: --batch prompts of 16 tokens, --decode-tokens output tokens each (ignore_eos);
  output tokens/s (decode batches of --batch rows).

Each configuration is set_quant_integer_gemm_rows(rows): 0 is the float path (main's kernels),
QUANT_INTEGER_GEMM_MAX_ROWS the default, "all" every row count.

    python bench/bench_quant_gemm_model.py [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench_attention import machine_description
from vpage import LLM, SamplingParams, _core, ops

ALL_ROWS = 1 << 40


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="kernel threads (default: vpage's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32)
    args = p.parse_args()
    if args.threads:
        ops.set_num_threads(args.threads)
    llm = LLM(dtype="float32", device="cpu", max_model_len=1024, max_num_batched_tokens=2048)
    vocab = llm.get_tokenizer().vocab_size
    rng = np.random.default_rng(0)
    configs = {"float path (0)": 0, f"default ({_core.QUANT_INTEGER_GEMM_MAX_ROWS})": _core.QUANT_INTEGER_GEMM_MAX_ROWS,
               "all rows": ALL_ROWS}

    def prompts(count, length):
        return [rng.integers(100, vocab - 100, length).tolist() for _ in range(count)]

    def timed(rows, batch, params):
        _core.set_quant_integer_gemm_rows(rows)
        try:
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            return time.perf_counter() - start
        finally:
            _core.set_quant_integer_gemm_rows(_core.QUANT_INTEGER_GEMM_MAX_ROWS)

    prefill = SamplingParams(temperature=0.0, max_tokens=1)
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    for rows in configs.values():  # warm-up
        timed(rows, prompts(2, 64), prefill)
    results = {name: ([], []) for name in configs}
    for r in range(args.repeats):
        names = list(configs)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            t = timed(configs[name], prompts(args.prompts, args.prompt_len), prefill)
            results[name][0].append(args.prompts * args.prompt_len / t)
            t = timed(configs[name], prompts(args.batch, 16), decode)
            results[name][1].append(args.batch * args.decode_tokens / t)
    print(f"CPU: {machine_description()}; vpage ISA: {_core.quant_matmul_isa()}; threads: {ops.get_num_threads()}; "
          f"wall time, median of {args.repeats}")
    print(f"| integer GEMM rows | prefill tok/s ({args.prompts} x {args.prompt_len}) | "
          f"decode tok/s (batch {args.batch}, {args.decode_tokens} tokens, incl. 16-token prefill) |")
    print("|---|---:|---:|")
    for name, (pre, dec) in results.items():
        print(f"| {name} | {statistics.median(pre):.0f} | {statistics.median(dec):.1f} |")


if __name__ == "__main__":
    main()
