"""Speculative decoding: vpage with and without it, and llama.cpp's own, on the same files, one run.

    python bench/bench_spec_decode.py [--llama-bin DIR] [--parts grounded,random,draft,batch]
                                      [--threads 2] [--k 4] [--repeats 2] [--interleave] [--markdown out.md]

Every part serves one trace through ``vpage bench serve``'s streaming client (greedy,
``ignore_eos``) on a freshly started server per system, the systems one after the other (with
``--interleave``, the one-stream parts start every system's server at once and send each request
to each system in turn, so that all systems meet the same moments of a machine whose speed moves):

grounded  one stream, ``bench/data/spec_grounded.jsonl``: 8 requests whose output copies their
          prompt (code and prose of this repository, frozen in the file): n-gram prompt lookup.
random    one stream, the first 8 requests of the synthetic trace (random words; nothing to
          look up): n-gram, which must cost nothing when it finds nothing.
draft     one stream, the first 8 synthetic requests: the default model's weights in float32 as
          the target, its Q4_1 file as the draft model.
batch     64 streams, the first 128 synthetic requests: n-gram (with speculative decoding's
          batch-size switch-off, ``disable_by_batch_size``) against none.

Systems: ``vpage serve`` (none / ngram / draft_model) and, with ``--llama-bin`` (a folder holding
llama.cpp's ``llama-server`` and ``llama-quantize``), ``llama-server`` (none / ``--spec-type
ngram-simple`` / ``-md DRAFT``), with --k draft tokens at most on both sides. The float32 target
is the default model dequantized: a safetensors folder for vpage (transformers' GGUF loader) and
an F32 GGUF for llama.cpp (``llama-quantize --allow-requantize``). Reported per system: output
tok/s (best round), its ratio to its baseline (best against best, and the median of the ratios
within each round), TPOT percentiles and, where the server reports it, the draft acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_llamacpp import _VPAGE_URL, cpu_name, start_llama_process  # noqa: E402
from bench_vllm_cpu import export_folder  # noqa: E402
from vpage.benchmarks.serve import load_jsonl, run_benchmark, synthetic_trace  # noqa: E402
from vpage.model_executor.loader.default_model import default_model_path  # noqa: E402

GROUNDED = Path(__file__).resolve().parent / "data" / "spec_grounded.jsonl"


def start_vpage(args, model: str, slots: int, spec: Optional[dict]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "vpage.cli", "serve", "--model", model, "--port", "0", "--device", "cpu",
           "--max-num-seqs", str(slots), "--kv-cache-memory", "1", "--no-prefix-caching"]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        match = _VPAGE_URL.search(line)
        if match:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, match.group(1)
    raise RuntimeError("vpage serve did not start")


_llama_ports = iter(range(18081, 18181))  # llama-server needs a port: each start takes the next


def start_llama(args, model: str, slots: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = next(_llama_ports)
    cmd = [os.path.join(args.llama_bin, "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots), "-cb", "-c", str(slots * 1024),
           "-fa", "on", "--no-webui", *extra]
    if args.no_repack:
        cmd.append("--no-repack")
    proc = start_llama_process(cmd, args.llama_bin, f"http://127.0.0.1:{port}/health")
    return proc, f"http://127.0.0.1:{port}/v1"


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def show(name: str, report: dict, requests: int) -> dict:
    spec = report.get("spec_decode")
    accepted = f", {spec['acceptance_rate']:.0%} of drafts accepted" if spec else ""
    print(f"  {name}: {report['output_throughput']:.1f} output tok/s, TPOT p50 {report['tpot_ms']['median']:.1f} ms"
          f"{accepted} ({report['completed']}/{requests})", flush=True)
    return dict(report, system=name)


def measure(name: str, start: Callable[[], tuple[subprocess.Popen, str]], trace, concurrency: int) -> dict:
    proc, url = start()
    try:
        return show(name, run_benchmark(url, trace, max_concurrency=concurrency, progress=False), len(trace))
    finally:
        stop(proc)


def measure_interleaved(systems: list[tuple[str, Callable]], trace) -> list[dict]:
    """One stream: every system's server up at once, and each request of the trace sent to each
    system in turn, so that the systems share the machine's moments (this VM's speed moves
    within a run): per system, output tok/s over all its requests' time, TPOT percentiles over
    its requests' TPOTs, draft acceptance over all its drafts."""
    started = []
    try:
        for name, start in systems:
            started.append((name, *start()))
        per_request = {name: [] for name, _, _ in started}
        for item in trace:
            for name, _, url in started:
                per_request[name].append(run_benchmark(url, [item], max_concurrency=1, progress=False))
    finally:
        for _, proc, _ in started:
            stop(proc)
    rows = []
    for name, reports in per_request.items():
        tpots = sorted(r["tpot_ms"]["median"] for r in reports if r["tpot_ms"]["median"] is not None)
        specs = [r["spec_decode"] for r in reports if r.get("spec_decode")]
        drafts, accepted = sum(x["draft_tokens"] for x in specs), sum(x["accepted_tokens"] for x in specs)
        report = {"output_throughput": sum(r["total_output_tokens"] for r in reports) / sum(r["duration_s"] for r in reports),
                  "completed": sum(r["completed"] for r in reports),
                  "tpot_ms": {"median": statistics.median(tpots) if tpots else None,
                              "p99": tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))] if tpots else None},
                  "spec_decode": {"acceptance_rate": accepted / drafts} if drafts else None}
        rows.append(show(name, report, len(trace)))
    return rows


def f32_gguf(args, work: Path) -> str:
    """The default model's weights as an F32 GGUF (llama.cpp's draft-model target)."""
    out = work / "smollm2-f32.gguf"
    if not out.exists():
        env = dict(os.environ, LD_LIBRARY_PATH=args.llama_bin)
        subprocess.run([os.path.join(args.llama_bin, "llama-quantize"), "--allow-requantize", str(default_model_path()),
                        str(out), "F32"], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return str(out)


def parts(args, work: Path) -> dict[str, list[dict]]:
    k = args.k
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    llama_ngram = ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(k)]
    q4 = str(default_model_path())
    synthetic = synthetic_trace(128, 0)
    plans = {
        "grounded": (load_jsonl(str(GROUNDED)), 1, q4, [("none", None, []), ("ngram", ngram, llama_ngram)]),
        "random": (synthetic[:8], 1, q4, [("none", None, []), ("ngram", ngram, llama_ngram)]),
        "batch": (synthetic, 64, q4, [("none", None, []), ("ngram", {**ngram, "disable_by_batch_size": 8},
                                                          llama_ngram)]),
    }
    results: dict[str, list[dict]] = {}
    for part in args.parts:
        rows = []
        if part == "draft":
            target = str(export_folder(work, "float32"))
            trace, conc = synthetic[:8], 1
            draft = {"model": q4, "num_speculative_tokens": k}
            systems = [("vpage none", lambda: start_vpage(args, target, 1, None)),
                       ("vpage draft", lambda: start_vpage(args, target, 1, draft))]
            if args.llama_bin:
                f32 = f32_gguf(args, work)
                systems += [("llama.cpp none", lambda: start_llama(args, f32, 1, [])),
                            ("llama.cpp draft", lambda: start_llama(args, f32, 1, ["-md", q4, "--spec-draft-n-max",
                                                                                   str(k)]))]
        else:
            trace, conc, model, variants = plans[part]
            systems = [(f"vpage {v}", lambda s=s: start_vpage(args, model, conc, s)) for v, s, _ in variants]
            if args.llama_bin:
                systems += [(f"llama.cpp {v}", lambda e=e: start_llama(args, model, conc, e)) for v, _, e in variants]
        print(f"{part}: {len(trace)} requests, concurrency {conc}", flush=True)
        for round_index in range(args.repeats):
            if args.interleave and conc == 1:
                rows += [dict(r, round=round_index) for r in measure_interleaved(systems, trace)]
                continue
            for name, start in systems:
                rows.append(dict(measure(name, start, trace, conc), round=round_index))
        results[part] = rows
    return results


def best(rows: list[dict], system: str) -> dict:
    return max((r for r in rows if r["system"] == system), key=lambda r: r["output_throughput"])


def round_ratios(rows: list[dict], system: str, baseline: str) -> list[float]:
    """The system's output tok/s over its baseline's in the same round, round by round."""
    base = {r["round"]: r["output_throughput"] for r in rows if r["system"] == baseline}
    return [r["output_throughput"] / base[r["round"]] for r in rows if r["system"] == system and r["round"] in base]


def markdown(results: dict[str, list[dict]], header: str) -> str:
    lines = [header, "", "| part | system | output tok/s (best) | vs its baseline (best / per-round median) | "
             "TPOT p50 / p99 ms | accepted |", "|---|---|---:|---:|---:|---:|"]
    for part, rows in results.items():
        for system in dict.fromkeys(r["system"] for r in rows):
            r = best(rows, system)
            baseline = system.split()[0] + " none"
            ratios = round_ratios(rows, system, baseline)
            spec = r.get("spec_decode")
            accepted = f"{spec['acceptance_rate']:.0%}" if spec else "-"
            lines.append(f"| {part} | {system} | {r['output_throughput']:.1f} | "
                         f"{r['output_throughput'] / best(rows, baseline)['output_throughput']:.2f}x / "
                         f"{statistics.median(ratios):.2f}x | "
                         f"{r['tpot_ms']['median']:.1f} / {r['tpot_ms']['p99']:.1f} | {accepted} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-bin", default=None, help="folder with llama.cpp's llama-server and llama-quantize")
    parser.add_argument("--parts", default="grounded,random,draft,batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="draft tokens at most (both systems)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds of every system, the systems in turn within a round")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "vpage-bench-spec"),
                        help="where the float32 copies go")
    parser.add_argument("--no-repack", action="store_true",
                        help="llama-server --no-repack (its AMX kernels crash on VMs that do not grant AMX state)")
    parser.add_argument("--interleave", action="store_true",
                        help="one-stream parts: all systems' servers up at once, each request sent to each in turn")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    args.parts = args.parts.split(",")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    import vpage._core as core

    header = (f"CPU: {cpu_name()}, vpage ISA {core.cpu_isa()}, {args.threads} threads, k = {args.k}, "
              f"{time.strftime('%Y-%m-%d')}")
    print(header, flush=True)
    results = parts(args, work)
    table = markdown(results, header)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")


if __name__ == "__main__":
    main()
