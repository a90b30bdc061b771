"""Structured outputs under load: `vpage serve` at 64 streams on the 256-request trace with a
JSON schema on every request vs none, against the same server in the same run, and the
grammar compile time per schema (cold and cached).

    python bench/bench_structured_serving.py [--schema bench/schemas/orders.json] [--rounds 1]
        [--structured-outputs-backend xgrammar] [--num-requests 256] [--max-concurrency 64]

The trace is `vpage bench serve`'s seeded synthetic one (greedy, ignore_eos, outputs of 16-256
tokens). The default schema (an order list of at least 16 items) cannot end within 256
tokens, so every constrained request produces exactly as many tokens as the unconstrained
one, each under an active grammar. Runs alternate (none, schema; then schema, none; ...) so
drift of a shared machine falls on both. Compile times are measured in this process with
the engine's compiler (the backend and tokenizer the server uses): "cold" compiles a distinct
copy of the schema each time (one more optional property), "cached" asks again for one
already compiled, plus a fresh matcher (what every later request with that schema costs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from vpage.benchmarks.serve import format_report, request_schemas, run_benchmark, synthetic_trace

_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_description() -> str:
    """lscpu's model name and the ISA extensions the kernels care about."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    isa = [f for f in _ISA_FLAGS if f in flags]
    model = (f"{fields.get('Model name', '?').strip()} (family {fields.get('CPU family', '?').strip()} model "
             f"{fields.get('Model', '?').strip()})")
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(isa) or 'no AVX2'}"


def compile_times(schema: dict, backend: str, repeats: int) -> dict:
    """Mean seconds: building the backend (its tokenizer tables, once per engine), a cold
    compile, and a cached one (lookup + a fresh matcher)."""
    from vpage.model_executor.loader.default_model import default_model_path
    from vpage.sampling_params import StructuredOutputsParams
    from vpage.structured_output import StructuredOutputCompiler
    from vpage.tokenizer import get_tokenizer

    path = default_model_path()
    tokenizer = get_tokenizer(path.parent, path.name)
    compiler = StructuredOutputCompiler(backend, tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    start = time.perf_counter()
    compiler.backend  # noqa: B018 - builds it
    build = time.perf_counter() - start
    variants = request_schemas(repeats, schema, unique=True)
    cold = []
    for variant in variants:
        start = time.perf_counter()
        compiler.submit(StructuredOutputsParams(json=variant)).result()
        cold.append(time.perf_counter() - start)
    cached = []
    for _ in range(repeats):
        start = time.perf_counter()
        compiler.matcher(compiler.submit(StructuredOutputsParams(json=variants[0])).result())
        cached.append(time.perf_counter() - start)
    compiler.shutdown()
    return {"backend_build_s": build, "cold_s": sum(cold) / len(cold), "cached_s": sum(cached) / len(cached),
            "repeats": repeats}


def start_server(args) -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_serving import start_vpage_serve

    return start_vpage_serve(["--dtype", args.dtype, "--kv-cache-memory", str(args.kv_cache_memory),
                              "--max-num-seqs", str(args.max_num_seqs), "--no-prefix-caching",
                              "--structured-outputs-backend", args.structured_outputs_backend])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schema", default=str(Path(__file__).parent / "schemas" / "orders.json"))
    p.add_argument("--structured-outputs-backend", default="xgrammar", choices=["xgrammar", "llguidance"])
    p.add_argument("--rounds", type=int, default=1, help="pairs of runs (none + schema), alternating order")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB of KV cache")
    p.add_argument("--compile-repeats", type=int, default=10)
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    with open(args.schema) as f:
        schema = json.load(f)
    print(cpu_description())
    compiles = compile_times(schema, args.structured_outputs_backend, args.compile_repeats)
    print(f"compile ({args.structured_outputs_backend}): backend build {compiles['backend_build_s'] * 1e3:.0f} ms "
          f"once; per schema cold {compiles['cold_s'] * 1e3:.1f} ms, cached {compiles['cached_s'] * 1e3:.3f} ms")
    trace = synthetic_trace(args.num_requests, args.seed)
    constrained = request_schemas(len(trace), schema)
    proc, url = start_server(args)
    runs = []
    try:
        # warm-up: the first steps' allocations fall on neither mode (no schema: its compile is part of the run)
        run_benchmark(url, trace[:4], max_concurrency=4, progress=False)
        for r in range(args.rounds):
            for mode in (("none", "schema") if r % 2 == 0 else ("schema", "none")):
                report = run_benchmark(url, trace, max_concurrency=args.max_concurrency, seed=args.seed,
                                       schemas=constrained if mode == "schema" else None)
                report["mode"], report["round"] = mode, r + 1
                print(f"\nround {r + 1}, {mode}:\n{format_report(report)}")
                runs.append(report)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"\n{'round':>5} {'mode':>6} {'ok':>4} {'out tok/s':>10} {'TPOT p50':>9} {'TPOT p99':>9} {'TTFT p99':>9}")
    for rep in runs:
        print(f"{rep['round']:>5} {rep['mode']:>6} {rep['completed']:>4} {rep['output_throughput']:>10.1f} "
              f"{rep['tpot_ms']['median']:>9.0f} {rep['tpot_ms']['p99']:>9.0f} {rep['ttft_ms']['p99']:>9.0f}")
    for r in range(args.rounds):
        none, constr = (next(x for x in runs if x["round"] == r + 1 and x["mode"] == m) for m in ("none", "schema"))
        ratio = constr["output_throughput"] / none["output_throughput"]
        print(f"round {r + 1}: schema / none output tok/s {ratio:.3f}x, "
              f"TPOT p99 {constr['tpot_ms']['p99'] / none['tpot_ms']['p99']:.3f}x")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"cpu": cpu_description(), "compile": compiles, "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
