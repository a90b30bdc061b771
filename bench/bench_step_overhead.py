"""Where an engine step's time goes outside the model: scheduling, cache operations, the
sampler and output processing (commit, stop rules, detokenization, RequestOutputs), at N
running decode sequences on the default model, or (``--tiny-model DIR``) on an engine-bound
model: a tiny random Llama with the default model's 49,152-token vocabulary and tokenizer,
whose forward costs next to nothing, so that the step is the engine's own work.

    python bench/bench_step_overhead.py --batch 64,256 --steps 12
    python bench/bench_step_overhead.py --tiny-model DIR --batch 64,256    # engine-bound model, made in DIR
    python bench/bench_step_overhead.py --single-stream      # batch 1: 128 new tokens, tok/s
    python bench/bench_step_overhead.py --long 4096          # one request: overhead per token over its life

Each batch size gets its own engine; N requests with 32-token prompts and long outputs are
run until every one of them decodes, then --steps steps are timed. The model's forward
(forward + logits: ``ModelRunner.logits``, or ``ModelRunner.execute`` before the model runner
sampled) is the only "model" time; everything else in ``LLMEngine.step`` is overhead, reported
per step and per sequence ("sample" is the sampler, wherever it runs).
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

PARTS = ("schedule", "sampling rows", "sample", "update", "process outputs", "model")


def _runner(engine):
    """The model runner (engines before the worker package kept it as ``engine.runner``)."""
    executor = getattr(engine, "executor", None)
    return executor.driver_worker.model_runner if hasattr(executor, "driver_worker") else engine.runner


def _model_step(runner):
    """(name, function) of the runner's forward + logits: ``logits`` since the model runner
    samples, ``execute`` before."""
    return ("logits", runner.logits) if hasattr(runner, "logits") else ("execute", runner.execute)


def _sampler(engine):
    """The sampler: the model runner's, or the engine's before the model runner sampled."""
    return engine.sampler if hasattr(engine, "sampler") else _runner(engine).sampler


def make_tiny_model(folder: str) -> None:
    """A random 2-layer Llama (hidden 64) with the default model's vocabulary and tokenizer,
    saved as a Hugging Face folder (once; an existing folder is kept)."""
    from pathlib import Path

    if (Path(folder) / "config.json").is_file():
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    from vpage.model_executor.loader.model_loader import load_model

    tokenizer = load_model(None, "float32", "cpu", "auto").tokenizer  # the default model's
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _engine_args(args, **kwargs) -> EngineArgs:
    if args.tiny_model:
        return EngineArgs(model=args.tiny_model, dtype="float32", device="cpu",
                          kv_cache_memory=args.kv_cache_memory, **kwargs)
    return EngineArgs(dtype=args.dtype, device="cpu", quantization=args.quantization,
                      kv_cache_memory=args.kv_cache_memory, **kwargs)


def _instrument(engine, totals: dict) -> None:
    """Times the parts of a step: the scheduler's schedule(), the model, the sampler, and the
    processing after sampling (the core's update and the front end's text since the engine core
    was split out; before, the output processor did both, and built the sampling rows apart)."""
    core = getattr(engine, "core", None)
    if core is not None:
        core.scheduler = _Timed(core.scheduler, totals)
        core.update = timed(totals, "update", core.update)
    else:
        engine.scheduler = engine.outputs.scheduler = _Timed(engine.scheduler, totals)
        engine.outputs.sampling_rows = timed(totals, "sampling rows", engine.outputs.sampling_rows)
    name, execute = _model_step(_runner(engine))
    setattr(_runner(engine), name, timed(totals, "model", execute))
    sampler = _sampler(engine)
    sampler.sample = timed(totals, "sample", sampler.sample)
    engine.outputs.process = timed(totals, "process outputs", engine.outputs.process)


def _params(**kwargs):
    """SamplingParams with ``output_kind`` when this vpage has it (older ones were cumulative)."""
    kind = kwargs.pop("output_kind", None)
    if kind is not None and "output_kind" in SamplingParams.__dataclass_fields__:
        from vpage.sampling_params import RequestOutputKind

        kwargs["output_kind"] = RequestOutputKind[kind]
    return SamplingParams(**kwargs)


def long_request(args) -> None:
    """One request of --long tokens (32-token prompt, greedy, ignore_eos): the time outside the
    model per generated token, over the first and the last 512 decode steps, in wall-clock time
    and in the engine thread's CPU time (which a busy or drifting VM disturbs less)."""
    engine = LLMEngine(_engine_args(args, max_num_seqs=1))
    params = _params(temperature=0.0, max_tokens=args.long, ignore_eos=True, output_kind=args.output_kind)
    engine.add_request("long", [100 + (7 * j) % 9000 for j in range(32)], params)
    model = {"wall": 0.0, "cpu": 0.0}
    runner = _runner(engine)
    name, execute = _model_step(runner)

    def timed_execute(*a, **k):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return execute(*a, **k)
        finally:
            model["wall"] += time.perf_counter() - wall
            model["cpu"] += time.thread_time() - cpu

    setattr(runner, name, timed_execute)
    wall_overhead, cpu_overhead = [], []
    for _ in range(args.long + 1):
        if not engine.has_unfinished_requests():
            break
        before = dict(model)
        wall, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        wall_overhead.append(time.perf_counter() - wall - (model["wall"] - before["wall"]))
        cpu_overhead.append(time.thread_time() - cpu - (model["cpu"] - before["cpu"]))
    cells = []
    for series in (wall_overhead[1:], cpu_overhead[1:]):  # the first step is the prefill
        window = min(512, len(series) // 2)
        first, last = statistics.mean(series[:window]), statistics.mean(series[-window:])
        cells += [f"{1e6 * first:.1f}", f"{1e6 * last:.1f}", f"{last / first:.2f}"]
    print(f"| {args.long} | {args.output_kind or 'default'} | " + " | ".join(cells) + " |", flush=True)


def timed(store: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            store[name] += time.perf_counter() - t0
    return wrapper


def measure(batch: int, steps: int, args) -> dict:
    engine = LLMEngine(_engine_args(args, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch)))
    params = _params(temperature=0.0, max_tokens=4096, ignore_eos=True, output_kind=args.output_kind)
    for i in range(batch):
        engine.add_request(str(i), [100 + (7 * i + j) % 9000 for j in range(32)], params)
    prefill_done = 0
    while prefill_done < 2:  # until every request decodes (two steps without prefill tokens)
        before = engine.scheduler.stats.num_prefill_tokens
        engine.step()
        waiting = engine.scheduler.num_waiting
        prefill_done = prefill_done + 1 if not waiting and engine.scheduler.stats.num_prefill_tokens == before else 0
    totals: dict = defaultdict(float)
    _instrument(engine, totals)
    step_times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    total = sum(step_times)
    return dict(batch=batch, step_ms=1e3 * statistics.median(step_times), total=total,
                parts={k: totals[k] for k in PARTS}, steps=steps)


def single_stream(args) -> None:
    """One request, a 32-token prompt, --new-tokens greedy tokens: decode tokens/s (wall clock
    and process CPU time, which includes the kernels' worker threads) and the step's split."""
    engine = LLMEngine(_engine_args(args, max_num_seqs=1))
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    for rep in range(args.repeats):
        engine.add_request(f"r{rep}", [100 + (7 * j) % 9000 for j in range(32)], params)
        engine.step()  # prefill + first token
        totals: dict = defaultdict(float)
        runner, sampler = _runner(engine), _sampler(engine)
        (name, execute), sample, process = _model_step(runner), sampler.sample, engine.outputs.process
        setattr(runner, name, timed(totals, "model", execute))
        sampler.sample = timed(totals, "sample", sample)
        engine.outputs.process = timed(totals, "process outputs", process)
        steps = 0
        wall, cpu = time.perf_counter(), time.process_time()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        setattr(runner, name, execute)
        sampler.sample, engine.outputs.process = sample, process
        other = wall - sum(totals.values())
        print(f"| 1 | {args.new_tokens} | {steps / wall:.1f} | {1e3 * wall / steps:.2f} | {1e3 * cpu / steps:.2f} | "
              f"{1e3 * totals['model'] / steps:.2f} | {1e3 * totals['sample'] / steps:.2f} | "
              f"{1e3 * totals['process outputs'] / steps:.2f} | {1e3 * other / steps:.2f} |", flush=True)


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
    parser.add_argument("--single-stream", action="store_true", help="batch 1 decode tokens/s instead")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long", type=int, default=0, help="one request of this many tokens instead")
    parser.add_argument("--tiny-model", default=None, metavar="DIR",
                        help="an engine-bound tiny random model with the default model's vocabulary (made in DIR "
                             "if missing) instead of the default model")
    parser.add_argument("--output-kind", default=None, choices=["CUMULATIVE", "DELTA", "FINAL_ONLY"],
                        help="the RequestOutputKind the requests ask for (default: SamplingParams')")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.tiny_model:
        make_tiny_model(args.tiny_model)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"# {cpu}, vpage ISA {_core.cpu_isa()}, {args.threads} threads, torch {torch.__version__}, "
          f"model {args.tiny_model or 'default'}, dtype {args.dtype}, quantization {args.quantization}, "
          f"output kind {args.output_kind or 'default'}")
    if args.long:
        print("| tokens | output kind | non-model wall us/token, first 512 | last 512 | last / first | "
              "thread CPU us/token, first 512 | last 512 | last / first |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        long_request(args)
        return
    if args.single_stream:
        print("| seqs | new tokens | decode tok/s | wall ms/step | process CPU ms/step | model ms/step | "
              "sample ms/step | process outputs ms/step | rest ms/step |")
        print("|" + "---:|" * 9)
        single_stream(args)
        return
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
