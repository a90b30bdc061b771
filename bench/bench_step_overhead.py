"""Where an engine step's time goes outside the model: scheduling, cache operations, the
sampler and output processing (commit, stop rules, detokenization, RequestOutputs), at N
running decode sequences on the default model.

    python bench/bench_step_overhead.py --batch 64,256 --steps 12

Each batch size gets its own engine; N requests with 32-token prompts and long outputs are
run until every one of them decodes, then --steps steps are timed. The model's forward
(``ModelRunner.execute``: forward + logits) is the only "model" time; everything else in
``LLMEngine.step`` is overhead, reported per step and per sequence.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections import defaultdict

import torch

from vpage import SamplingParams, _core
from vpage.engine import EngineArgs, LLMEngine

PARTS = ("schedule", "sampling rows", "sample", "process outputs", "model")


def timed(store: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            store[name] += time.perf_counter() - t0
    return wrapper


def measure(batch: int, steps: int, args) -> dict:
    engine = LLMEngine(EngineArgs(dtype=args.dtype, device="cpu", quantization=args.quantization,
                                  kv_cache_memory=args.kv_cache_memory, max_num_seqs=batch,
                                  max_num_batched_tokens=max(2048, batch)))
    params = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [100 + (7 * i + j) % 9000 for j in range(32)], params)
    prefill_done = 0
    while prefill_done < 2:  # until every request decodes (two steps without prefill tokens)
        before = engine.scheduler.stats.num_prefill_tokens
        engine.step()
        waiting = engine.scheduler.num_waiting
        prefill_done = prefill_done + 1 if not waiting and engine.scheduler.stats.num_prefill_tokens == before else 0
    totals: dict = defaultdict(float)
    engine.scheduler = engine.outputs.scheduler = _Timed(engine.scheduler, totals)
    engine.runner.execute = timed(totals, "model", engine.runner.execute)
    engine.sampler.sample = timed(totals, "sample", engine.sampler.sample)
    engine.outputs.sampling_rows = timed(totals, "sampling rows", engine.outputs.sampling_rows)
    engine.outputs.process = timed(totals, "process outputs", engine.outputs.process)
    step_times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    total = sum(step_times)
    return dict(batch=batch, step_ms=1e3 * statistics.median(step_times), total=total,
                parts={k: totals[k] for k in PARTS}, steps=steps)


class _Timed:
    """The scheduler, with schedule() timed."""

    def __init__(self, scheduler, totals):
        self._scheduler = scheduler
        self.schedule = timed(totals, "schedule", scheduler.schedule)

    def __getattr__(self, name):
        return getattr(self._scheduler, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="64,256")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--kv-cache-memory", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"# {cpu}, vpage ISA {_core.cpu_isa()}, {args.threads} threads, torch {torch.__version__}, "
          f"dtype {args.dtype}, quantization {args.quantization}")
    print("| running seqs | step median ms | model % | non-model % | non-model us/step | us/seq | "
          + " | ".join(f"{p} us/step" for p in PARTS[:-1]) + " |")
    print("|" + "---:|" * (6 + len(PARTS) - 1))
    for batch in [int(b) for b in args.batch.split(",")]:
        r = measure(batch, args.steps, args)
        per_step = {k: 1e6 * v / r["steps"] for k, v in r["parts"].items()}
        overhead = 1e6 * r["total"] / r["steps"] - per_step["model"]
        share = overhead / (1e6 * r["total"] / r["steps"])
        print(f"| {batch} | {r['step_ms']:.1f} | {100 * (1 - share):.1f} | {100 * share:.1f} | {overhead:.0f} | "
              f"{overhead / batch:.1f} | " + " | ".join(f"{per_step[p]:.0f}" for p in PARTS[:-1]) + " |", flush=True)


if __name__ == "__main__":
    main()
