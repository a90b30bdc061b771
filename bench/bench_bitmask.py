"""The token-bitmask ops of structured outputs (vpage.ops) against the torch expressions they
replaced, per call, on one machine in one run.

    python bench/bench_bitmask.py                                  # rows 1,64,256 x vocab 49152,151936
    python bench/bench_bitmask.py --rows 1 --vocab 151936 --threads 1,2 --repeat 15
    python bench/bench_bitmask.py --masks sparse --json out.json

Ops (float32 logits [rows, vocab], int32 bitmask [rows, ceil(vocab / 32)]):
apply          ops.apply_token_bitmask_(logits, bitmask)      logits.masked_fill_(~allowed(bitmask), -inf)
lse_argmax     ops.logsumexp_argmax(logits, bitmask=bitmask)  torch.logsumexp(logits, -1) and
                                                              logits.masked_fill(~allowed, -inf).argmax(-1)
lse_argmax is also timed without a bitmask ("unmasked" column): the cost of a mask is the ratio.

Masks: random (each token allowed with probability 1/2), sparse (1 token in 500 allowed, like a
grammar state inside a JSON string key), ones (every token allowed). The torch peer expands the
bitmask to a bool [rows, vocab] on every call, as the torch implementation did.

Each case is timed `--repeat` times, vpage and torch alternating (a batch of calls of ~20 ms
each); the table gives the median time per call in microseconds, the spread (min-max) and
torch / vpage. Compare ratios: the machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from vpage import _core, ops


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def torch_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab] of the allowed tokens (the torch implementation's expansion)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def make_bitmask(kind: str, rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    words = ops.token_bitmask_words(vocab)
    if kind == "ones":
        return torch.full((rows, words), -1, dtype=torch.int32)
    if kind == "random":
        return torch.randint(-2**31, 2**31, (rows, words), dtype=torch.int64, generator=gen).to(torch.int32)
    if kind == "sparse":
        bits = torch.rand(rows, words * 32, generator=gen) < 1 / 500
        weights = (1 << torch.arange(32, dtype=torch.int64))
        packed = (bits.view(rows, words, 32).long() * weights).sum(-1)
        return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    raise ValueError(f"unknown mask kind {kind}")


def time_alternating(fns, repeat: int) -> list[list[float]]:
    """Seconds per call of each fn, `repeat` samples each (batches of ~20 ms), taken in turn."""
    batch = []
    for fn in fns:
        fn()
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < 0.02:
            fn()
            calls += 1
        batch.append(calls)
    samples = [[] for _ in fns]
    for _ in range(repeat):
        for fn, calls, out in zip(fns, batch, samples):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - start) / calls)
    return samples


def cases(op: str, logits: torch.Tensor, bitmask: torch.Tensor):
    """(vpage call, torch call[, vpage call without a bitmask]) for one op."""
    vocab = logits.shape[1]
    if op == "apply":
        return [lambda: ops.apply_token_bitmask_(logits, bitmask),
                lambda: logits.masked_fill_(~torch_allowed(bitmask, vocab), float("-inf"))]

    def torch_lse_argmax():
        allowed = torch_allowed(bitmask, vocab)
        return torch.logsumexp(logits, -1), logits.masked_fill(~allowed, float("-inf")).argmax(-1)
    return [lambda: ops.logsumexp_argmax(logits, bitmask=bitmask), torch_lse_argmax,
            lambda: ops.logsumexp_argmax(logits)]


def fmt(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e6:.1f} ({min(samples) * 1e6:.1f}-{max(samples) * 1e6:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="apply,lse_argmax")
    parser.add_argument("--rows", default="1,64,256")
    parser.add_argument("--vocab", default="49152,151936")
    parser.add_argument("--masks", default="random,sparse,ones")
    parser.add_argument("--threads", default=str(torch.get_num_threads()), help="comma-separated thread counts")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    print(f"# {cpu_name()}, {os.cpu_count()} logical CPUs, vpage ISA {_core.cpu_isa()}, torch {torch.__version__}, "
          f"median of {args.repeat} (spread min-max), us per call")
    print("| op | mask | rows | vocab | threads | vpage us | torch us | **torch / vpage** | unmasked vpage us |"
          " masked / unmasked |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    results = []
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        ops.set_num_threads(threads)
        for op in args.ops.split(","):
            for kind in args.masks.split(","):
                for vocab in map(int, args.vocab.split(",")):
                    for rows in map(int, args.rows.split(",")):
                        gen = torch.Generator().manual_seed(rows * 7 + vocab)
                        logits = torch.randn(rows, vocab, generator=gen) * 4
                        bitmask = make_bitmask(kind, rows, vocab, gen)
                        samples = time_alternating(cases(op, logits, bitmask), args.repeat)
                        med = [statistics.median(s) * 1e6 for s in samples]
                        unmasked = (f"{fmt(samples[2])} | {med[0] / med[2]:.2f}" if len(samples) > 2 else "- | -")
                        print(f"| {op} | {kind} | {rows} | {vocab} | {threads} | {fmt(samples[0])} | "
                              f"{fmt(samples[1])} | **{med[1] / med[0]:.1f}** | {unmasked} |", flush=True)
                        results.append(dict(op=op, mask=kind, rows=rows, vocab=vocab, threads=threads,
                                            vpage_us=med[0], torch_us=med[1],
                                            unmasked_us=med[2] if len(med) > 2 else None,
                                            samples_us=[[x * 1e6 for x in s] for s in samples]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu_name(), isa=_core.cpu_isa(), torch=torch.__version__, rows=results), f, indent=1)


if __name__ == "__main__":
    main()
