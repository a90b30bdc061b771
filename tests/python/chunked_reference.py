"""Logits step by step: vpage's model fed chunks of several sequences per step, and
transformers' forward fed the same chunks of one sequence over its KV cache (as its generate
feeds a prompt, then one token a step), for rope kinds whose rotation depends on the context
length."""

from __future__ import annotations

import copy
from typing import Any

import torch

from model_fixtures import PagedKVCache


def vpage_logits_per_chunk(loaded: Any, tokens: dict[int, list[int]],
                           steps: list[dict[int, int]]) -> dict[int, list[torch.Tensor]]:
    """Per sequence, the logits of each of its chunks: step i feeds ``steps[i][s]`` more
    tokens of ``tokens[s]`` to each sequence s it names, all in one batch."""
    cache = PagedKVCache(loaded.config, block_size=8)
    fed = {s: 0 for s in tokens}
    out: dict[int, list[torch.Tensor]] = {s: [] for s in tokens}
    for step in steps:
        chunks = {s: tokens[s][fed[s]:fed[s] + n] for s, n in step.items()}
        logits = loaded.model.compute_logits(loaded.model(cache.step(chunks), cache.caches))
        row = 0
        for s, n in step.items():
            out[s].append(logits[row:row + n])
            row += n
            fed[s] += n
    return out


def hf_logits_per_chunk(hf: Any, tokens: list[int], chunks: list[int]) -> list[torch.Tensor]:
    """transformers' logits for each chunk of ``tokens`` (sizes ``chunks``), fed one chunk
    after another over its KV cache, by a copy of ``hf`` (a fresh dynamic-rope state)."""
    from transformers import DynamicCache

    hf = copy.deepcopy(hf)
    cache, out, start = DynamicCache(config=hf.config), [], 0
    with torch.no_grad():
        for n in chunks:
            out.append(hf(torch.tensor([tokens[start:start + n]]), cache=cache, use_cache=True).logits[0])
            start += n
    return out


def assert_chunks_match(loaded: Any, hf: Any, steps: list[dict[int, int]], seed: int = 0, atol: float = 1e-4) -> None:
    """vpage's logits over ``steps`` (random tokens) equal transformers' chunk by chunk."""
    gen = torch.Generator().manual_seed(seed)
    seqs = sorted({s for step in steps for s in step})
    total = {s: sum(step.get(s, 0) for step in steps) for s in seqs}
    tokens = {s: torch.randint(3, hf.config.vocab_size, (total[s],), generator=gen).tolist() for s in seqs}
    ours = vpage_logits_per_chunk(loaded, tokens, steps)
    for s in seqs:
        expected = hf_logits_per_chunk(hf, tokens[s], [step[s] for step in steps if s in step])
        assert ours[s][0].abs().max() > 0.01  # a real signal
        for got, ref in zip(ours[s], expected):
            torch.testing.assert_close(got, ref, atol=atol, rtol=0)
