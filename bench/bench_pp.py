"""Pipeline parallelism on this machine: end-to-end throughput of pp = 2 against tp = 2 (and one
rank) on the same model, threads split evenly over the ranks.

    python bench/bench_pp.py                                   # SmolLM2-135M's shape, 8 heads, float32
    python bench/bench_pp.py --model DIR/llama-0.6b-L8-Q4_1.gguf --configs tp1,tp2,pp2   # GGUF kept quantized
    python bench/bench_pp.py --configs pp2:1,pp2:2,pp2:4,pp2:8 --num-requests 32   # micro-batches per step
    python bench/bench_pp.py --configs pp2 --backend ray       # the stages as Ray actors

A config is ``tpN`` (N tensor-parallel ranks), ``ppN`` (N stages, VPAGE_PP_MICROBATCHES and
VPAGE_PP_VIRTUAL_STAGES left at their defaults), ``ppN:M`` (at most M micro-batches a step),
``ppNvV`` (V interleaved layer ranges per stage; ``ppN:MvV`` both), or ``ppNtpK``. The trace is
bench_throughput.py's (seeded, ShareGPT-like lengths, greedy, ignore_eos), all requests added at
once. Without ``--model`` a random Llama of the default model's size (30 layers, hidden 576, MLP
1536, vocabulary 49,152, tied embeddings) with 8 heads / 4 KV heads is built in a temporary
folder (the default model's 9 heads cannot split over 2 ranks). Each config runs in its own
process, in turn, ``--repeat`` rounds alternating; the table gives every round.

Last, what a step sends between stages, alone: gloo point-to-point between two idle local
processes of the bytes of a decode step of 64 and 256 sequences (activations forward, logits
back to the driver), for the two-machine estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_attention import machine_description  # noqa: E402
from bench_throughput import make_trace  # noqa: E402
from bench_tp import even_heads_model, spawn_ranks  # noqa: E402

_CONFIG = re.compile(r"^(?:tp(\d+))?(?:pp(\d+))?(?:tp(\d+))?(?::(\d+))?(?:v(\d+))?$")


def parse_config(name: str) -> dict:
    m = _CONFIG.match(name)
    if not m or not any(m.groups()[:3]):
        raise SystemExit(f"bad config {name!r}: tpN, ppN, ppN:M, ppNvV, ppN:MvV or ppNtpK")
    tp = int(m.group(1) or m.group(3) or 1)
    return dict(tp=tp, pp=int(m.group(2) or 1), microbatches=m.group(4), virtual=m.group(5))


def run_config(args) -> dict:
    """One config in this process: the whole trace, output tokens per second."""
    from vpage import EngineArgs, LLMEngine, SamplingParams

    c = parse_config(args.run)
    if c["microbatches"]:
        os.environ["VPAGE_PP_MICROBATCHES"] = c["microbatches"]
    if c["virtual"]:
        os.environ["VPAGE_PP_VIRTUAL_STAGES"] = c["virtual"]
    backend = args.backend if c["tp"] * c["pp"] > 1 else None
    engine = LLMEngine(EngineArgs(model=args.model, dtype="float32", quantization=args.quantization,
                                  kv_cache_memory=args.kv_cache_memory, num_threads=args.threads,
                                  distributed_executor_backend=backend,
                                  tensor_parallel_size=c["tp"], pipeline_parallel_size=c["pp"],
                                  max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=4096))
    try:
        parallel = engine.config.parallel
        trace = make_trace(args.num_requests, args.seed, engine.model_config.vocab_size)
        start = time.perf_counter()
        for i, (prompt, out_len) in enumerate(trace):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
        output_tokens = steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    output_tokens += len(out.outputs[0].token_ids)
        wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    return dict(config=args.run, layers=list(parallel.pipeline_layers), microbatches=parallel.pipeline_microbatches,
                output_tokens=output_tokens, wall_s=wall, output_tok_s=output_tokens / wall, steps=steps)


def _p2p_rank(rank: int, size: int, port: int, sizes: list[int], repeat: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    medians = []
    for n in sizes:
        x = torch.ones(n // 4)
        times = []
        for _ in range(repeat):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
            else:
                dist.recv(x, 0)
            dist.barrier()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    if rank == 1:
        out.put(medians)
    dist.destroy_process_group()


def p2p_alone(sizes: list[int], repeat: int = 7) -> list[float]:
    """Seconds to send each of ``sizes`` bytes from one idle local process to another (gloo)."""
    return spawn_ranks(_p2p_rank, 2, sizes, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: a random SmolLM2-sized model with 8 heads")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--configs", default="tp1,tp2,pp2")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--kv-cache-memory", type=float, default=1.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--backend", default="mp", choices=["mp", "ray"])
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # one config, in a child process
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_config(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = even_heads_model(Path(tmp))
        rows = []
        for round_ in range(args.repeat):
            for config in args.configs.split(","):
                parse_config(config)
                argv = [sys.executable, __file__, "--run", config, "--model", args.model,
                        "--quantization", args.quantization, "--num-requests", str(args.num_requests),
                        "--seed", str(args.seed), "--threads", str(args.threads),
                        "--kv-cache-memory", str(args.kv_cache_memory),
                        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--backend", args.backend]
                out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                row["round"] = round_ + 1
                rows.append(row)
                print(json.dumps(row), flush=True)
    lines = [machine_description(), "",
             f"model: {args.model or 'random SmolLM2-135M shape, 8 heads'}; {args.num_requests} requests; "
             f"{args.threads} threads in all; backend {args.backend}", "",
             "| config | round | layers per stage | micro-batches | output tokens | wall s | output tok/s |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        layers = "/".join(map(str, r["layers"])) or "-"
        micro = r["microbatches"] if r["layers"] else "-"
        lines.append(f"| {r['config']} | {r['round']} | {layers} | {micro} | {r['output_tokens']} | "
                     f"{r['wall_s']:.1f} | {r['output_tok_s']:.1f} |")
    # A decode step of SmolLM2-135M's shape (hidden 576, vocabulary 49,152, float32): activations
    # [2, rows, 576] forward, logits [rows, 49152] back.
    sizes = [(rows, what, n) for rows in (64, 256) for what, n in (("activations", 2 * rows * 576 * 4),
                                                                  ("logits", rows * 49152 * 4))]
    seconds = p2p_alone([n for _, _, n in sizes])
    lines += ["", "| decode rows | message | bytes | gloo send, idle local processes ms | MB/s |",
              "|---:|---|---:|---:|---:|"]
    for (rows, what, n), t in zip(sizes, seconds):
        lines.append(f"| {rows} | {what} | {n} | {t * 1e3:.2f} | {n / t / 1e6:.0f} |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
