"""Replays n-gram lookup rules over greedy outputs: how many steps each rule would take.

    python bench/spec_lookup_replay.py [--data bench/data/spec_grounded.jsonl] [--k 4,8]

Generates the trace's greedy outputs once with the default model (LLM.generate), then for each
rule walks every output as speculative decoding would: at each step the rule proposes up to k
tokens from prompt + output so far, the step keeps the leading drafts that equal the output,
plus one token. Prints steps, steps with drafts and the share of drafts kept per rule, so that
a change of lookup rule can be judged without timing anything (RESULTS-spec.md).

Rules: "latest" is vpage's (cpp/src/ngram_proposer.cpp: the latest earlier occurrence of the
longest suffix n-gram, n from max down to min); "longest" takes the occurrence whose match
reaches furthest back (uncapped), latest first among equals.
"""
import argparse
import json
from pathlib import Path

MAX_BACK = 64  # how far back "longest" compares


def propose_latest(tokens, min_n, max_n, k):
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        for start in range(size - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def propose_longest(tokens, min_n, max_n, k):
    size, best, best_len = len(tokens), None, 0
    for end in range(size - 2, -1, -1):  # end: last token of a candidate occurrence
        length = 0
        while length <= end and length < MAX_BACK and tokens[end - length] == tokens[size - 1 - length]:
            length += 1
        if length > best_len:
            best, best_len = end, length
    if best is None or best_len < min_n:
        return []
    return tokens[best + 1:best + 1 + k]


def replay(pairs, rule, min_n, max_n, k):
    steps = draft_steps = drafted = kept = 0
    for prompt, output in pairs:
        t = 0
        while t < len(output):
            drafts = rule(prompt + output[:t], min_n, max_n, k)[:len(output) - t - 1]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == output[t + accepted]:
                accepted += 1
            steps += 1
            draft_steps += bool(drafts)
            drafted += len(drafts)
            kept += accepted
            t += accepted + 1
    return steps, draft_steps, drafted, kept


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=str(Path(__file__).parent / "data" / "spec_grounded.jsonl"))
    parser.add_argument("--k", default="4,8", help="draft counts to replay")
    args = parser.parse_args()

    from vpage import LLM, SamplingParams
    from vpage.model_executor.loader.default_model import default_model_path

    rows = [json.loads(line) for line in open(args.data)]
    llm = LLM(model=str(default_model_path()))
    params = [SamplingParams(max_tokens=r["output_len"], temperature=0, ignore_eos=True) for r in rows]
    outs = llm.generate([r["prompt"] for r in rows], params, use_tqdm=False)
    pairs = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
    total = sum(len(out) for _, out in pairs)

    print(f"{len(pairs)} requests, {total} output tokens")
    print("| rule | n | k | steps | steps with drafts | drafts kept |")
    print("|---|---|---:|---:|---:|---:|")
    for k in (int(v) for v in args.k.split(",")):
        for name, rule in (("latest", propose_latest), ("longest", propose_longest)):
            for min_n in (2, 1):
                steps, draft_steps, drafted, kept = replay(pairs, rule, min_n, 4, k)
                share = kept / drafted if drafted else 0.0
                print(f"| {name} | {min_n}-4 | {k} | {steps} | {draft_steps} | {share:.0%} |", flush=True)


if __name__ == "__main__":
    main()
