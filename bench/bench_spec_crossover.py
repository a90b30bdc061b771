"""Where n-gram speculation stops paying: offline, by batch size and temperature, one run.

    python bench/bench_spec_crossover.py [--streams 1,4,16,64] [--temperatures 0,1]
                                         [--rounds 2] [--markdown out.md]

For each number of streams c, ``LLM.generate`` runs 2c requests of the synthetic random-word
trace (4 at c = 1) with ``max_num_seqs`` c, the default model, ``ignore_eos``, without
speculation and with n-gram drafts (k = 4, lookup 2-4, no ``disable_by_batch_size``), the systems
alternating within each round. Greedy decoding of random words falls into repetition that the
lookup finds; sampling at temperature 1 (seeded per request) rarely repeats, so most drafts are
rejected: the low-acceptance case that decides ``disable_by_batch_size``. Reported: output tok/s
(best round), the ratio to no speculation, the share of drafts accepted.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_llamacpp import cpu_name  # noqa: E402
from vpage import LLM, SamplingParams  # noqa: E402
from vpage.benchmarks.serve import synthetic_trace  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def run(streams: int, temperature: float, spec) -> tuple[float, float]:
    """(output tok/s, share of drafts accepted) of one generate call."""
    trace = synthetic_trace(max(2 * streams, 4), 0)
    llm = LLM(max_num_seqs=streams, speculative_config=spec, enable_prefix_caching=False)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=n, ignore_eos=True)
              for i, (_, n) in enumerate(trace)]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in trace], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.engine.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    accepted = stats.spec_decode_num_accepted_tokens / max(stats.spec_decode_num_draft_tokens, 1)
    llm.engine.shutdown()
    del llm
    gc.collect()
    return tokens / seconds, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,4,16,64")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    import vpage._core as core

    header = f"CPU: {cpu_name()}, vpage ISA {core.cpu_isa()}, {time.strftime('%Y-%m-%d')}"
    print(header, flush=True)
    lines = [header, "", "| temperature | streams | none tok/s | n-gram tok/s | ratio | drafts accepted |",
             "|---:|---:|---:|---:|---:|---:|"]
    for temperature in map(float, args.temperatures.split(",")):
        for streams in map(int, args.streams.split(",")):
            best = {"none": 0.0, "ngram": 0.0}
            accepted = 0.0
            for _ in range(args.rounds):
                for name, spec in (("none", None), ("ngram", NGRAM)):
                    tok_s, share = run(streams, temperature, spec)
                    best[name] = max(best[name], tok_s)
                    accepted = share if spec else accepted
                    print(f"  T={temperature} c={streams} {name}: {tok_s:.1f} tok/s", flush=True)
            lines.append(f"| {temperature:g} | {streams} | {best['none']:.1f} | {best['ngram']:.1f} | "
                         f"{best['ngram'] / best['none']:.2f}x | {accepted:.0%} |")
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")


if __name__ == "__main__":
    main()
