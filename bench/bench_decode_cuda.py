"""Decode step time on CUDA with and without CUDA graphs, on the default model.

    python bench/bench_decode_cuda.py --batch 1,8,64 --steps 30 --out decode.md

For each mode (graphs, then --enforce-eager) one engine (max_num_seqs = the largest batch,
a fixed KV cache) runs, for each batch size N, N requests with 32-token prompts until all of
them decode, then times --steps whole engine steps (schedule, block moves, forward, sampling,
outputs) and the forward alone (``ModelRunner.logits``: forward and logits, synchronized), then profiles a few
more steps (torch.profiler, CUDA activity) for the GPU kernels a step launches and the time
they keep the GPU busy. Prints a markdown table: median ms per step and per forward, eager /
graphs ratios, kernels per step and GPU-busy ms per step.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from vpage import SamplingParams
from vpage.engine import EngineArgs, LLMEngine


def kernel_profile(engine: LLMEngine, steps: int = 3) -> tuple[float, float]:
    """(GPU kernels per step, ms the kernels keep the GPU busy per step) over ``steps`` steps;
    NaNs when the profiler sees no kernels (CUPTI unavailable)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    if not kernels:
        return float("nan"), float("nan")
    return len(kernels) / steps, sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps


def decode_times(engine: LLMEngine, batch: int, steps: int) -> tuple[float, float, float, float]:
    """(median step ms, median forward ms, kernels per step, GPU-busy ms per step) over
    ``steps`` decode steps of ``batch`` rows."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [100 + (7 * i + j) % 9000 for j in range(32)], params)
    quiet = 0
    while quiet < 2:  # until every request decodes: two steps without prefill tokens, none waiting
        before = engine.scheduler.stats.num_prefill_tokens
        engine.step()
        idle = not engine.scheduler.num_waiting and engine.scheduler.stats.num_prefill_tokens == before
        quiet = quiet + 1 if idle else 0
    for _ in range(3):  # warm-up decode steps
        engine.step()
    forward = []
    execute = engine.executor.driver_worker.model_runner.logits

    def timed_execute(*args, **kwargs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = execute(*args, **kwargs)
        torch.cuda.synchronize()
        forward.append(time.perf_counter() - t0)
        return out

    engine.executor.driver_worker.model_runner.logits = timed_execute
    step = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step.append(time.perf_counter() - t0)
    engine.executor.driver_worker.model_runner.logits = execute
    kernels, busy = kernel_profile(engine)
    engine.abort_request(ids)
    return 1e3 * statistics.median(step), 1e3 * statistics.median(forward), kernels, busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,8,64")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory", type=float, default=4.0)
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    results = {}
    for eager in (False, True):
        engine = LLMEngine(EngineArgs(dtype=args.dtype, device="cuda", kv_cache_memory=args.kv_cache_memory,
                                      max_num_seqs=max(batches), enforce_eager=eager))
        dtype = str(engine.model_config.dtype).removeprefix("torch.")
        for b in batches:
            results[eager, b] = decode_times(engine, b, args.steps)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, dtype {dtype}, block size 16, "
             f"32-token prompts, median of {args.steps} decode steps", "",
             "| batch | step ms graphs | step ms eager | eager / graphs | forward ms graphs | forward ms eager |"
             " eager / graphs | kernels / step (graphs, eager) | GPU-busy ms / step (graphs, eager) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for b in batches:
        (sg, fg, kg, bg), (se, fe, ke, be) = results[False, b], results[True, b]
        lines.append(f"| {b} | {sg:.2f} | {se:.2f} | {se / sg:.2f}x | {fg:.2f} | {fe:.2f} | {fe / fg:.2f}x | "
                     f"{kg:.0f}, {ke:.0f} | {bg:.2f}, {be:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
