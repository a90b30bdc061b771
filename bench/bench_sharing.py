"""What memory sharing saves, end to end: parallel sampling, prefix caching, swap vs recompute.

    python bench/bench_sharing.py                  # the default model, float32 (~7 min on 2 shared cores)
    python bench/bench_sharing.py --tiny           # a tiny random Llama built on the spot (~1 min)
    python bench/bench_sharing.py --sections parallel,prefix --threads 2

Three sections, each in its own process (the model is loaded once per section and shared by
the engines of that section, which run one after the other):

parallel   KV blocks in use (peak and mean over engine steps) for parallel sampling with
           n = 2, 4, 6 (one request of n samples per prompt: the prompt blocks are shared,
           the partly filled last one is copied on write) against n independent requests per
           prompt (nothing shared). Prefix caching is off in both, so only sharing counts.
           Seeded ShareGPT-like lengths (bench_throughput.make_trace), temperature 0.8,
           ignore_eos, so every sample runs to its request's max_tokens. Beam search with
           width 2, 4, 6 on the same prompts: blocks in use against the blocks the running
           beams would hold with a private copy of their context each.
prefix     requests/s of a few-shot workload with prefix caching on vs off: every prompt is
           an instruction + k examples (shared by all requests) + its own short question;
           one-shot (k=1) and five-shot (k=5); all requests queued at once. "warm": one
           untimed request served the prefix first (a steady serving state, as in the paper);
           "cold": no warm-up, so the requests admitted in the first step all compute the
           prefix (blocks enter the cache only when their step commits).
swap       wall time of one trace under a KV pool far too small for it, with preemption
           forced to recompute and to swap, beside the same trace on an ample pool; greedy
           outputs are compared across the three runs.

Anchors (vLLM paper, OPT-13B on A100, their workloads): parallel sampling saves 6.1-9.8%
(Alpaca) to 16.2-30.5% (ShareGPT) of KV memory; shared prefixes give 1.67x (one-shot) and
3.58x (five-shot) throughput. Compare ratios from one run: the machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_throughput import make_trace  # noqa: E402


# ------------------------------------------------------------------------ helpers

def memoize_model_loading() -> None:
    """Every engine of a section reuses one loaded model (the weights are read only)."""
    import vpage.engine.llm_engine as le

    cache = {}
    load = le.load_model

    def cached(*args):
        if args not in cache:
            cache[args] = load(*args)
        return cache[args]

    le.load_model = cached


def make_engine(args, **kwargs):
    from vpage.engine import EngineArgs, LLMEngine

    base = dict(model=args.model, dtype=args.dtype, device="cpu", num_threads=args.threads,
                kv_cache_memory=args.kv_cache_memory, block_size=args.block_size)
    base.update(kwargs)
    return LLMEngine(EngineArgs(**base))


def private_blocks(engine) -> int:
    """Blocks the running sequences would hold if none were shared (a private copy each)."""
    scheduler, bs, total = engine.scheduler, engine.config.cache.block_size, 0
    for request_id in engine.requests:
        group = scheduler.find_group(request_id)
        for i in range(group.num_seqs if group else 0):
            seq = group.seq(i)
            if seq.status == seq.status.RUNNING:
                total += -(-seq.num_computed_tokens // bs)
    return total


def drain(engine, count_private: bool = False) -> tuple[dict, list[int], float]:
    """Runs until idle: final outputs by id, used KV blocks after each step (with
    count_private, pairs (used, private_blocks) instead), wall seconds."""
    scheduler, outs, used = engine.scheduler, {}, []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        usage = scheduler.usage()
        in_use = usage.num_gpu_blocks - usage.free_gpu_blocks
        used.append((in_use, private_blocks(engine)) if count_private else in_use)
    return outs, used, time.perf_counter() - start


# ----------------------------------------------------------------------- sections

def run_parallel(args) -> dict:
    from vpage import SamplingParams

    engine = make_engine(args, enable_prefix_caching=False)
    vocab, max_len = engine.model_config.vocab_size, engine.max_model_len
    trace = [(p[: max_len // 2], min(o, args.max_output, max_len // 2 - 1))
             for p, o in make_trace(args.parallel_requests, args.seed, vocab)]
    rows = []
    for n in args.n_values:
        row = dict(n=n)
        for kind in ("shared", "independent"):
            for i, (prompt, out_len) in enumerate(trace):
                params = dict(temperature=0.8, max_tokens=out_len, ignore_eos=True)
                if kind == "shared":
                    engine.add_request(f"{n}-{i}", prompt, SamplingParams(n=n, seed=args.seed + i, **params))
                else:
                    for j in range(n):
                        engine.add_request(f"{n}-{i}-{j}", prompt,
                                           SamplingParams(seed=args.seed + i * 100 + j, **params))
            before = engine.scheduler.stats.num_prefill_tokens
            _, used, wall = drain(engine)
            row[kind] = dict(peak=max(used), mean=float(np.mean(used)), steps=len(used), wall_s=wall,
                             prefill_tokens=engine.scheduler.stats.num_prefill_tokens - before)
        rows.append(row)
    beams = []
    for width in args.n_values:  # beam search: blocks held vs a private copy per running beam
        for i, (prompt, out_len) in enumerate(trace):
            engine.add_request(f"beam{width}-{i}", prompt, SamplingParams(
                n=1, best_of=width, use_beam_search=True, temperature=0.0, max_tokens=out_len, ignore_eos=True))
        _, pairs, wall = drain(engine, count_private=True)
        pairs = [(u, p) for u, p in pairs if p]
        beams.append(dict(width=width, peak=max(u for u, _ in pairs), private_peak=max(p for _, p in pairs),
                          mean=float(np.mean([u for u, _ in pairs])), private_mean=float(np.mean([p for _, p in pairs])),
                          wall_s=wall))
    return dict(rows=rows, beams=beams, requests=len(trace), prompt_tokens=[len(p) for p, _ in trace],
                output_tokens=[o for _, o in trace], kv_blocks=engine.scheduler.usage().num_gpu_blocks)


def few_shot_trace(args, vocab: int, shots: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(args.seed + shots)
    instruction = rng.integers(100, vocab - 100, 16).tolist()
    prefix = instruction + rng.integers(100, vocab - 100, shots * args.example_tokens).tolist()
    questions = np.clip(rng.lognormal(np.log(20), 0.4, args.prefix_requests), 8, 48).astype(int)
    outputs = np.clip(rng.lognormal(np.log(20), 0.4, args.prefix_requests), 8, 48).astype(int)
    return [(prefix + rng.integers(100, vocab - 100, q).tolist(), int(o)) for q, o in zip(questions, outputs)]


def run_prefix(args) -> dict:
    from vpage import SamplingParams

    rows = []
    for shots in (1, 5):
        row = dict(shots=shots)
        for name, caching, warm in (("off", False, True), ("cold", True, False), ("warm", True, True)):
            engine = make_engine(args, enable_prefix_caching=caching)
            trace = few_shot_trace(args, engine.model_config.vocab_size, shots)
            if warm:  # the few-shot prefix was served before (untimed), as in a steady serving state
                engine.add_request("warm-up", trace[0][0], SamplingParams(temperature=0.0, max_tokens=1))
                drain(engine)
            before = engine.get_stats()
            for i, (prompt, out_len) in enumerate(trace):
                engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
            outs, _, wall = drain(engine)
            after = engine.get_stats()
            cache = engine.scheduler.usage().prefix_cache
            row[name] = dict(wall_s=wall, requests_s=len(trace) / wall,
                             prefill_tokens=after.prefill_tokens - before.prefill_tokens,
                             hit_rate=cache.hits / cache.queries if cache.queries else 0.0,
                             tokens=[outs[str(i)].outputs[0].token_ids for i in range(len(trace))])
            row["prompt_tokens"] = float(np.mean([len(p) for p, _ in trace]))
            row["prefix_tokens"] = 16 + shots * args.example_tokens
        reference = row["off"].pop("tokens")
        row["equal"] = all(row[k].pop("tokens") == reference for k in ("cold", "warm"))
        rows.append(row)
    return dict(rows=rows, requests=args.prefix_requests)


def run_swap(args) -> dict:
    from vpage import SamplingParams
    from vpage.worker.cache_engine import bytes_per_block

    rows, reference, engine = [], None, None
    max_model_len = args.swap_pool_blocks * args.block_size  # the small pool must hold one whole sequence
    for mode in ("ample", "recompute", "swap"):  # "ample" first: its engine gives the block size in bytes
        kwargs = dict(max_model_len=max_model_len)
        if mode != "ample":
            block_bytes = bytes_per_block(engine.model_config, args.block_size)
            kwargs.update(preemption_mode=mode, kv_cache_memory=args.swap_pool_blocks * block_bytes / 2**30)
        engine = make_engine(args, **kwargs)
        vocab, max_len = engine.model_config.vocab_size, engine.max_model_len
        trace = [(p[: max_len // 2], min(o, args.max_output, max_len // 2 - 1))
                 for p, o in make_trace(args.swap_requests, args.seed + 1, vocab)]
        for i, (prompt, out_len) in enumerate(trace):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
        outs, used, wall = drain(engine)
        tokens = [outs[str(i)].outputs[0].token_ids for i in range(len(trace))]
        reference = reference or tokens
        stats = engine.get_stats()
        rows.append(dict(mode=mode, wall_s=wall, steps=stats.num_steps, peak_blocks=max(used),
                         kv_blocks=engine.scheduler.usage().num_gpu_blocks, prefill_tokens=stats.prefill_tokens,
                         recompute=stats.num_preempted_recompute, swap=stats.num_preempted_swap,
                         equal=tokens == reference))
    demand = sum(-(-(len(p) + o) // args.block_size) for p, o in trace)
    return dict(rows=rows, requests=len(trace), demand_blocks=demand)


SECTIONS = {"parallel": run_parallel, "prefix": run_prefix, "swap": run_swap}


# ------------------------------------------------------------------------- report

def report(args, results: dict) -> None:
    import torch

    import vpage

    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"vpage {getattr(vpage, '__version__', '?')}; model {args.model_name}, {args.dtype}, block size "
          f"{args.block_size}, {args.threads} thread(s), seed {args.seed}\n")
    if "parallel" in results:
        r = results["parallel"]
        print(f"**Parallel sampling**: KV blocks in use, {r['requests']} prompts (tokens {r['prompt_tokens']}, "
              f"max_tokens {r['output_tokens']}), all queued at once, prefix caching off, pool {r['kv_blocks']} "
              "blocks (no preemption)\n")
        print("| sampling | n | blocks peak shared / independent | saving (peak) | blocks mean shared / independent "
              "| saving (mean) | prefill tokens shared / independent |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for row in r["rows"]:
            s, i = row["shared"], row["independent"]
            print(f"| parallel | {row['n']} | {s['peak']} / {i['peak']} | {100 * (1 - s['peak'] / i['peak']):.1f}% | "
                  f"{s['mean']:.1f} / {i['mean']:.1f} | {100 * (1 - s['mean'] / i['mean']):.1f}% | "
                  f"{s['prefill_tokens']} / {i['prefill_tokens']} |")
        for b in r["beams"]:
            print(f"| beam search | {b['width']} | {b['peak']} / {b['private_peak']} | "
                  f"{100 * (1 - b['peak'] / b['private_peak']):.1f}% | {b['mean']:.1f} / {b['private_mean']:.1f} | "
                  f"{100 * (1 - b['mean'] / b['private_mean']):.1f}% | - |")
        print("\nBeam search \"independent\": the blocks each running beam would hold with a private copy of its "
              "context (computed tokens), sampled after every step of the same run.")
        print("vLLM paper: parallel sampling saves 6.1-9.8% (Alpaca) to 16.2-30.5% (ShareGPT) of KV memory, "
              "beam search 37.6-55.2% (Alpaca) to 44.3-66.3% (ShareGPT).\n")
    if "prefix" in results:
        r = results["prefix"]
        print(f"**Prefix caching**: {r['requests']} requests, instruction (16 tokens) + k examples "
              f"({args.example_tokens} tokens each) shared + a question of 8-48 tokens; outputs 8-48 tokens, greedy\n")
        print("| workload | prefix / mean prompt tokens | req/s caching off | req/s on, cold | req/s on, warm "
              "| speedup cold / warm | prefill tokens off / cold / warm | hit rate cold / warm | same outputs |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for row in r["rows"]:
            off, cold, warm = row["off"], row["cold"], row["warm"]
            name = "one-shot" if row["shots"] == 1 else f"{row['shots']}-shot"
            print(f"| {name} | {row['prefix_tokens']} / {row['prompt_tokens']:.0f} | {off['requests_s']:.2f} | "
                  f"{cold['requests_s']:.2f} | {warm['requests_s']:.2f} | {cold['requests_s'] / off['requests_s']:.2f}x / "
                  f"{warm['requests_s'] / off['requests_s']:.2f}x | {off['prefill_tokens']} / {cold['prefill_tokens']} / "
                  f"{warm['prefill_tokens']} | {100 * cold['hit_rate']:.0f}% / {100 * warm['hit_rate']:.0f}% | "
                  f"{'yes' if row['equal'] else 'NO'} |")
        print("\nvLLM paper: 1.67x (one-shot) and 3.58x (five-shot).\n")
    if "swap" in results:
        r = results["swap"]
        print(f"**Swap vs recompute**: {r['requests']} requests needing {r['demand_blocks']} blocks in all, "
              f"greedy, all queued at once\n")
        print("| preemption | KV blocks | peak used | preempted (recompute / swap) | prefill tokens | steps | wall s "
              "| vs ample | same outputs |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        base = r["rows"][0]["wall_s"]
        for row in r["rows"]:
            print(f"| {row['mode']} | {row['kv_blocks']} | {row['peak_blocks']} | {row['recompute']} / {row['swap']} | "
                  f"{row['prefill_tokens']} | {row['steps']} | {row['wall_s']:.1f} | {row['wall_s'] / base:.2f}x | "
                  f"{'yes' if row['equal'] else 'NO'} |")
        print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="parallel,prefix,swap")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of the default model")
    p.add_argument("--model", default=None, help="a model folder or GGUF file (default: the default model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1 is fastest on a loaded shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB, except in the swap section's small pools")
    p.add_argument("--n-values", default="2,4,6")
    p.add_argument("--parallel-requests", type=int, default=4)
    p.add_argument("--max-output", type=int, default=96, help="cap of the trace's output lengths")
    p.add_argument("--prefix-requests", type=int, default=24)
    p.add_argument("--example-tokens", type=int, default=80, help="tokens per few-shot example")
    p.add_argument("--swap-requests", type=int, default=12)
    p.add_argument("--swap-pool-blocks", type=int, default=48, help="KV blocks in the forced-preemption runs")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    args.n_values = [int(n) for n in args.n_values.split(",")]

    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        memoize_model_loading()
        print(json.dumps(SECTIONS[args.worker](args)))
        return

    tmp = None
    if args.tiny and args.model is None:
        tmp = tempfile.TemporaryDirectory()
        sys.path.insert(0, str(HERE.parent / "tests" / "python"))
        from model_fixtures import save_tiny_model

        save_tiny_model("llama", Path(tmp.name), seed=3)
        args.model = tmp.name
        if "--example-tokens" not in sys.argv:
            args.example_tokens = 32  # five shots must fit the tiny model's 256 positions
        if "--swap-pool-blocks" not in sys.argv:
            args.swap_pool_blocks = 16
        if "--max-output" not in sys.argv:
            args.max_output = 64
    args.model_name = "tiny random llama" if args.tiny else (args.model or "SmolLM2-135M-Instruct (default)")
    results = {}
    argv = [a for a in sys.argv[1:] if a not in ("--tiny",)]
    for section in args.sections.split(","):
        cmd = [sys.executable, __file__, *argv, "--worker", section, "--example-tokens", str(args.example_tokens),
               "--swap-pool-blocks", str(args.swap_pool_blocks), "--max-output", str(args.max_output)]
        if args.model:
            cmd += ["--model", args.model]
        print(f"running section {section} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        results[section] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  section {section}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    report(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
