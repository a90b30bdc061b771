"""The random draw of temperature sampling: vpage's inverse-CDF draw (``sample_from_probs``, one
uniform number per row) against the exponential race it replaced (``probs / Exp(1)`` argmax,
one exponential per vocabulary entry), same process, alternating, seeded rows as a request
with ``seed`` has them.

    python bench/bench_sampling_draw.py [--vocab 49152] [--rows 1,8,64] [--threads 2] [--repeats 50]

Prints the CPU model, the instruction set and median microseconds per call.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench_attention import machine_description
from vpage import _core
from vpage.sampler import make_generator, sample_from_probs


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    race = torch.empty_like(probs).exponential_()
    for i, g in enumerate(generators):
        race[i].exponential_(generator=g)
    return probs.div(race).argmax(dim=-1)


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{machine_description()}; vpage ISA {_core.cpu_isa()}; torch {torch.__version__}; threads {args.threads}")
    print("| rows | vocab | exponential race us | inverse CDF us | race / inverse CDF |")
    print("|---:|---:|---:|---:|---:|")
    for rows in map(int, args.rows.split(",")):
        probs = torch.randn(rows, args.vocab, generator=torch.Generator().manual_seed(rows)).softmax(-1)
        generators = [make_generator(i) for i in range(rows)]
        race = inverse = float("inf")
        for _ in range(3):  # alternating rounds, the best median of each
            race = min(race, median_us(lambda: exponential_race(probs, generators), args.repeats))
            inverse = min(inverse, median_us(lambda: sample_from_probs(probs, generators), args.repeats))
        print(f"| {rows} | {args.vocab} | {race:.0f} | {inverse:.0f} | **{race / inverse:.1f}x** |")


if __name__ == "__main__":
    main()
