"""End-to-end throughput on the default model: vpage against transformers' generate.

    python bench/bench_throughput.py                       # the full comparison (~15 min on 2 cores)
    python bench/bench_throughput.py --num-requests 64 --systems vpage-float32
    python bench/bench_throughput.py --systems vpage-gguf-float32,vpage-float32   # GGUF blocks kept vs dequantized
    python bench/bench_throughput.py --device cuda --systems vpage-bfloat16,transformers-bfloat16 \
        --hf-batch-sizes 64,128,256                            # on a GPU (vpage with CUDA graphs)

A seeded synthetic trace with ShareGPT-like lengths (log-normal; prompts 16-512 tokens,
outputs 16-256, ignore_eos) is served by vpage (all requests at once, continuous batching)
and by transformers' generate in static batches (left-padded, each batch runs to its longest
output; the best batch size among --hf-batch-sizes is picked on the first --hf-pick-requests
requests, then run on the whole trace; a single size is run directly). Output tokens/s counts
the tokens each request asked for. Each system runs in its own process, so peak RSS is its own. KV-cache utilization is
tokens stored / slots allocated, averaged over vpage's steps, beside what reserving each
running request's prompt + max_tokens ("oracle") or max_model_len ("max") would have used.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import numpy as np


def make_trace(num_requests: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(140), 0.8, num_requests), 16, 512).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(90), 0.7, num_requests), 16, 256).astype(int)
    return [(rng.integers(100, vocab - 100, p).tolist(), int(o)) for p, o in zip(prompt_lens, output_lens)]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_vpage(args) -> dict:
    import torch

    from vpage import SamplingParams
    from vpage.engine import EngineArgs, LLMEngine

    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineArgs(dtype=args.dtype, device=args.device, quantization=args.quantization,
                                  kv_cache_memory=args.kv_cache_memory,
                                  max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens))
    trace = make_trace(args.num_requests, args.seed, engine.model_config.vocab_size)
    reserved = {}
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(trace):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
        reserved[str(i)] = len(prompt) + out_len
    scheduler, bs = engine.scheduler, engine.config.cache.block_size
    max_len = engine.max_model_len
    util, oracle, maxres, output_tokens = [], [], [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                output_tokens += len(out.outputs[0].token_ids)
        usage = scheduler.usage()
        used = usage.num_gpu_blocks - usage.free_gpu_blocks
        tokens = scheduler.num_kv_tokens()
        if used and tokens:
            running = [r for r in engine.requests
                       if scheduler.find_group(r).seq(0).status == scheduler.find_group(r).seq(0).status.RUNNING]
            util.append(tokens / (used * bs))
            oracle.append(tokens / sum(reserved[r] for r in running))
            maxres.append(tokens / (len(running) * max_len))
    wall = time.perf_counter() - start
    stats = engine.get_stats()
    name = "vpage-gguf" if args.quantization == "auto" else "vpage"
    return dict(system=f"{name}-{args.dtype}", dtype=args.dtype, batch="continuous", requests=len(trace),
                output_tokens=output_tokens, wall_s=wall, output_tok_s=output_tokens / wall,
                requests_s=len(trace) / wall, peak_rss_mib=peak_rss_mib(), kv_blocks=usage.num_gpu_blocks,
                block_size=bs, preempted=stats.num_preempted_recompute + stats.num_preempted_swap,
                kv_util=float(np.mean(util)), oracle_util=float(np.mean(oracle)), max_util=float(np.mean(maxres)),
                max_model_len=max_len, steps=stats.num_steps)


def run_hf(args) -> dict:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from vpage.model_executor.loader.default_model import default_model_path

    torch.set_num_threads(args.threads)
    path = default_model_path()
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"],
                          strict=False)
    model.tie_weights()
    model.to(getattr(torch, args.dtype)).to(args.device)
    trace = make_trace(args.num_requests, args.seed, config.vocab_size)[: args.limit or None]
    pad = 0
    start = time.perf_counter()
    generated = 0
    for b in range(0, len(trace), args.batch_size):
        batch = trace[b: b + args.batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=args.device)
        new = max(o for _, o in batch)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
        generated += (out.shape[1] - width) * len(batch)
    wall = time.perf_counter() - start
    output_tokens = sum(o for _, o in trace)
    return dict(system="transformers", dtype=args.dtype, batch=args.batch_size, requests=len(trace),
                output_tokens=output_tokens, generated_tokens=generated, wall_s=wall,
                output_tok_s=output_tokens / wall, requests_s=len(trace) / wall, peak_rss_mib=peak_rss_mib())


def worker(argv: list[str], args) -> dict:
    cmd = [sys.executable, __file__, "--worker", *argv, "--num-requests", str(args.num_requests),
           "--seed", str(args.seed), "--threads", str(args.threads), "--kv-cache-memory", str(args.kv_cache_memory),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--device", args.device]
    print("running:", " ".join(cmd[2:]), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # Each result as it comes, so a run cut short by a time limit still reports what finished.
    print(f"done: {result['system']} {result['dtype']} batch {result['batch']}: {result['output_tok_s']:.1f} "
          f"output tok/s, {result['wall_s']:.1f} s", file=sys.stderr, flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--systems", default="vpage-float32,vpage-bfloat16,transformers-float32")
    p.add_argument("--hf-batch-sizes", default="8,16,32")
    p.add_argument("--hf-pick-requests", type=int, default=64)
    p.add_argument("--kv-cache-memory", type=float, default=4.0, help="GiB of vpage KV cache")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="both systems run here")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--quantization", default="none", help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        result = run_vpage(args) if args.worker == "vpage" else run_hf(args)
        print(json.dumps(result))
        return

    results, picks = [], []
    for system in args.systems.split(","):
        name, dtype = system.rsplit("-", 1)
        if name in ("vpage", "vpage-gguf"):  # weights dequantized to dtype, or GGUF blocks kept
            quantization = "auto" if name == "vpage-gguf" else "none"
            results.append(worker(["vpage", "--dtype", dtype, "--quantization", quantization], args))
            continue
        sizes = args.hf_batch_sizes.split(",")
        if len(sizes) > 1:  # one size needs no pick
            picks = [worker(["hf", "--dtype", dtype, "--batch-size", b, "--limit", str(args.hf_pick_requests)], args)
                     for b in sizes]
            sizes = [str(max(picks, key=lambda r: r["output_tok_s"])["batch"])]
        results.append(worker(["hf", "--dtype", dtype, "--batch-size", sizes[0]], args))

    import torch

    gpu = f"{torch.cuda.get_device_name()}, " if args.device == "cuda" else ""
    print(f"\nmachine: {gpu}{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {args.threads} threads; {args.num_requests} requests, seed {args.seed}\n")
    if picks:
        print("transformers batch-size pick on the first", args.hf_pick_requests, "requests: " +
              ", ".join(f"{r['batch']}: {r['output_tok_s']:.1f} tok/s" for r in picks) + "\n")
    hf = {r["dtype"]: r for r in results if r["system"] == "transformers"}
    print("| system | dtype | batch | output tok/s | vs transformers | req/s | wall s | peak RSS MiB | KV blocks x block size |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        peer = hf.get(r["dtype"]) or hf.get("float32")
        ratio = f"{r['output_tok_s'] / peer['output_tok_s']:.2f}x" if peer else "-"
        blocks = f"{r['kv_blocks']} x {r['block_size']}" if "kv_blocks" in r else "-"
        print(f"| {r['system']} | {r['dtype']} | {r['batch']} | {r['output_tok_s']:.1f} | {ratio} | "
              f"{r['requests_s']:.2f} | {r['wall_s']:.0f} | {r['peak_rss_mib']:.0f} | {blocks} |")
    print("\n| system | KV utilization (stored / allocated) | reserve prompt+max_tokens | reserve max_model_len | preemptions | steps |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        if "kv_util" in r:
            print(f"| {r['system']} | {100 * r['kv_util']:.1f}% | {100 * r['oracle_util']:.1f}% | "
                  f"{100 * r['max_util']:.1f}% (max_model_len {r['max_model_len']}) | {r['preempted']} | {r['steps']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
