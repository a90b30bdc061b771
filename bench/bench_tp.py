"""Tensor parallelism on this machine: engine step time with tp = 1 and tp = 2, split into
compute, all-reduce, logits gather and step broadcast (perf counters around the collectives,
read on the driver, rank 0), with the all-reduce through shared memory and through gloo; and
each rank's memory: rank 0's weight bytes and the workers' peak resident memory.

    python bench/bench_tp.py --even-heads           # SmolLM2-135M's shape with 8 heads / 4 KV heads, tp 1 and 2
    python bench/bench_tp.py --sizes 1,3            # the default model (9 heads, 3 KV heads: tp 1 or 3)
    python bench/bench_tp.py --sizes 1,3 --quantization auto,none --allreduce shm   # GGUF blocks kept vs dequantized
    python bench/bench_tp.py --steps 10 --threads 2 --markdown out.md
    python bench/bench_tp.py --even-heads --allreduce shm       # only the shared-memory all-reduce

The default model cannot run with tp = 2 (9 query heads), so ``--even-heads`` builds a random
model of SmolLM2-135M's size (30 layers, hidden 576, MLP 1536, vocabulary 49,152, tied
embeddings) with 8 query heads and 4 KV heads of 64 in a temporary folder.

decode   64 requests of 32 prompt tokens, all decoding: the median of ``--steps`` steps.
prefill  one prompt of 2,048 tokens in one step (prefix caching off): the median of ``--repeat``.

The all-reduce time measured on the driver includes waiting for the slower rank (load
imbalance on a shared machine shows up there, not in compute). "compute" is the step minus
the collectives (it includes scheduling, sampling and output processing on the driver).
Threads: ``--threads`` in total, split evenly over the ranks (tp = 2: half each).
Last, the all-reduces alone: 61 back-to-back of one step's size between idle processes, per
transport (VPAGE_TP_ALLREDUCE), and single all-reduces of a few sizes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_attention import machine_description  # noqa: E402


def quantile(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def timed_steps(engine, count: int):
    """(step, all-reduce, gather, broadcast) seconds of each of ``count`` steps."""
    from vpage.distributed.parallel_state import COMM_TIME

    rows = []
    for _ in range(count):
        COMM_TIME.reset()
        start = time.perf_counter()
        engine.step()
        step = time.perf_counter() - start
        rows.append((step, COMM_TIME.all_reduce, COMM_TIME.gather, COMM_TIME.broadcast))
    return rows


def peak_rss(pid: int) -> int:
    """The peak resident memory (VmHWM) of process ``pid``, bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def bench_size(model, tp: int, threads: int, transport: str, quantization: str, args) -> dict:
    import psutil

    from vpage import EngineArgs, LLMEngine, SamplingParams

    os.environ["VPAGE_TP_ALLREDUCE"] = transport  # read by rank 0 when the engine starts
    engine = LLMEngine(EngineArgs(model=model, dtype="float32", quantization=quantization, kv_cache_memory=0.5,
                                  max_model_len=max(args.prefill + 1, 36 + args.steps),
                                  num_threads=threads, tensor_parallel_size=tp, enable_prefix_caching=False,
                                  max_num_batched_tokens=2048, max_num_seqs=256))
    try:
        net = engine.executor.driver_worker.loaded.model
        weights = sum(p.numel() * p.element_size() for p in net.parameters())
        rng = np.random.default_rng(0)
        vocab = engine.model_config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 4, ignore_eos=True)
        for i in range(args.batch):
            engine.add_request(f"d{i}", rng.integers(100, vocab - 1, 32).tolist(), params)
        while engine.scheduler.stats.num_prefill_tokens < 32 * args.batch:
            engine.step()
        timed_steps(engine, 2)  # warm-up
        decode = timed_steps(engine, args.steps)
        engine.abort_request([f"d{i}" for i in range(args.batch)])
        prefill = []
        for r in range(args.repeat + 1):
            engine.add_request(f"p{r}", rng.integers(100, vocab - 1, args.prefill).tolist(),
                               SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            rows = timed_steps(engine, 1)
            while engine.has_unfinished_requests():
                engine.step()
            if r:  # the first is a warm-up
                prefill += rows
        workers = [peak_rss(p.pid) for p in psutil.Process().children() if "resource_tracker" not in
                   " ".join(p.cmdline())]
    finally:
        engine.shutdown()
    return {"decode": decode, "prefill": prefill, "weights": weights, "worker_peak_rss": max(workers, default=None)}


def even_heads_model(folder: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return str(folder)


def _allreduce_rank(rank: int, size: int, port: int, transport: str, runs, repeat: int, out) -> None:
    import torch.distributed as dist

    from vpage.distributed import parallel_state as ps

    torch.set_num_threads(1)
    os.environ["VPAGE_TP_ALLREDUCE"] = transport
    ps.init_tensor_parallel(rank, size, f"tcp://127.0.0.1:{port}", "gloo", 120.0)
    assert ps.all_reduce_transport() == transport
    medians = []
    for shape, count in runs:
        x = torch.ones(shape)
        times = []
        for _ in range(repeat):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(count):
                ps.all_reduce(x)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    if rank == 0:
        out.put(medians)
    ps.destroy_tensor_parallel()


def allreduce_alone(size: int, transport: str, runs, repeat: int = 5) -> list[float]:
    """For each (shape, count) of ``runs``: seconds of ``count`` back-to-back all-reduces of
    ``shape`` float32 over ``size`` local processes with nothing else to do, through
    ``transport`` (shm or gloo): the transfer cost without waiting for a slower rank."""
    return spawn_ranks(_allreduce_rank, size, transport, runs, repeat)


def spawn_ranks(target, size: int, *args):
    """Runs ``target(rank, size, port, *args, out)`` in ``size`` spawned processes that meet at
    one local port; returns the first result put on ``out``."""
    import multiprocessing as mp

    from vpage.executor.tensor_parallel import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=target, args=(r, size, port, *args, out)) for r in range(size)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join()
    return result


def summarize(rows):
    med = [statistics.median(col) for col in zip(*rows)]
    step, allreduce, gather, bcast = med
    return dict(step=step, p10=quantile([r[0] for r in rows], 0.1), p90=quantile([r[0] for r in rows], 0.9),
                compute=step - allreduce - gather - bcast, allreduce=allreduce, gather=gather, bcast=bcast,
                comm_share=(allreduce + gather + bcast) / step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M)")
    parser.add_argument("--even-heads", action="store_true", help="a random SmolLM2-sized model with 8 heads")
    parser.add_argument("--sizes", default="1,2")
    parser.add_argument("--allreduce", default="shm,gloo", help="all-reduce transports to run tp > 1 with")
    parser.add_argument("--quantization", default="none",
                        help="EngineArgs.quantization values to run (auto: a GGUF file's blocks stay quantized)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args()
    from vpage import _core

    tmp = None
    model_name = args.model or "smollm2 (default model, 9 heads / 3 KV heads)"
    if args.even_heads:
        import tempfile

        tmp = tempfile.TemporaryDirectory()
        args.model = even_heads_model(Path(tmp.name))
        model_name = "random SmolLM2-135M-sized Llama, 8 heads / 4 KV heads of 64"
    lines = [f"machine: {machine_description()}, CPU ISA {_core.cpu_isa()}, torch {torch.__version__}, "
             f"float32, block size 16, {args.threads} threads in total; model: {model_name}",
             "",
             "| tp | quantization | all-reduce | phase | step ms (p10-p90) | tokens/s | compute ms | all-reduce ms "
             "| gather ms | broadcast ms | comm share | rank 0 weights MiB | worker peak RSS MiB |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    transports = args.allreduce.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    for tp in sizes:
        for quantization in args.quantization.split(","):
            for transport in transports if tp > 1 else ["-"]:
                result = bench_size(args.model, tp, args.threads, transport if tp > 1 else "auto", quantization, args)
                rss = result["worker_peak_rss"]
                memory = f"{result['weights'] / 2**20:.1f} | {'-' if rss is None else f'{rss / 2**20:.0f}'}"
                for phase in ("decode", "prefill"):
                    s = summarize(result[phase])
                    tokens = args.batch if phase == "decode" else args.prefill
                    label = f"decode, batch {args.batch}" if phase == "decode" else f"prefill, {args.prefill} tokens"
                    lines.append(f"| {tp} | {quantization} | {transport} | {label} | {s['step'] * 1e3:.1f} "
                                 f"({s['p10'] * 1e3:.1f}-{s['p90'] * 1e3:.1f}) | {tokens / s['step']:.0f} | "
                                 f"{s['compute'] * 1e3:.1f} | {s['allreduce'] * 1e3:.2f} | {s['gather'] * 1e3:.2f} | "
                                 f"{s['bcast'] * 1e3:.2f} | {100 * s['comm_share']:.1f}% | {memory} |")
                    print(lines[-1], flush=True)
    hidden = 576
    steps = [((args.batch, hidden), 61, f"decode: 61 all-reduces of [{args.batch}, {hidden}] float32 (one step's)"),
             ((args.prefill, hidden), 61, f"prefill: 61 all-reduces of [{args.prefill}, {hidden}] float32 (one step's)")]
    singles = [((1,), 200, "1 all-reduce of 4 bytes"), ((1024,), 200, "1 all-reduce of 4 KB"),
               ((64, hidden), 200, f"1 all-reduce of [64, {hidden}] float32 (147 KB)"),
               ((2048, hidden), 20, f"1 all-reduce of [2048, {hidden}] float32 (4.7 MB)")]
    for tp in [s for s in sizes if s > 1]:
        first = len(lines)
        lines += ["", f"All-reduces alone between {tp} idle local processes (1 thread each), nothing else running:", "",
                  "| all-reduces | " + " | ".join(f"{t} ms" for t in transports) + " |",
                  "|---|" + "---:|" * len(transports)]
        runs = [(shape, count) for shape, count, _ in steps + singles]
        timed = {t: allreduce_alone(tp, t, runs) for t in transports}
        for i, (shape, count, label) in enumerate(steps + singles):
            per_call = 1 if count == 61 else count  # steps: the whole step's 61; singles: per call
            cells = " | ".join(f"{timed[t][i] / per_call * 1e3:.3f}" for t in transports)
            lines.append(f"| {label} | {cells} |")
        print("\n".join(lines[first:]), flush=True)
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
