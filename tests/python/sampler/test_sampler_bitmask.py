"""Sampler with a token bitmask (structured outputs): every row picks an allowed token, greedy
rows the best allowed one (after bans and penalties), seeded random rows the token a masked
copy of their logits gives; free rows and every logprob are unchanged."""

from __future__ import annotations

import torch

from vpage import ops
from vpage.sampler import Sampler, SamplingRow, make_generator
from vpage.sampling_params import SamplingParams

VOCAB = 333  # not a multiple of 32: the last word is partial


def mask_rows(allowed: list[set[int] | None]) -> torch.Tensor:
    """int32 bitmask rows; None = free (all ones)."""
    out = torch.full((len(allowed), ops.token_bitmask_words(VOCAB)), -1, dtype=torch.int32)
    for i, tokens in enumerate(allowed):
        if tokens is not None:
            bits = torch.zeros(out.shape[1] * 32, dtype=torch.int64)
            bits[list(tokens)] = 1
            words = (bits.reshape(-1, 32) << torch.arange(32)).sum(-1)
            out[i] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return out


def test_bitmask_rows_pick_allowed_tokens_and_keep_raw_logprobs():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, VOCAB, generator=gen) * 4
    allowed = [set(torch.randperm(VOCAB, generator=gen)[:k].tolist()) for k in (5, 1, 40, 7)] + [None, None]
    allowed[2].add(VOCAB - 1)  # a token of the partial last word
    params = [SamplingParams(temperature=0.0, logprobs=2),  # greedy
              SamplingParams(temperature=0.0),  # one token allowed
              SamplingParams(temperature=0.8, top_k=5, seed=9),  # seeded random
              SamplingParams(temperature=0.0, repetition_penalty=1.5),  # penalised greedy
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=4)]  # free rows
    prompt, output = [1, 2], [3]

    def rows():
        return [SamplingRow(p, prompt, output, make_generator(p.seed) if p.seed is not None else None)
                for p in params]

    out = Sampler().sample(logits, rows(), mask_rows(allowed))
    tokens = out.token_ids.tolist()
    for i in range(4):
        assert tokens[i] in allowed[i]
    masked = logits.clone()
    for i in range(4):
        masked[i, [t for t in range(VOCAB) if t not in allowed[i]]] = float("-inf")
    assert tokens[0] == masked[0].argmax().item() and tokens[1] == next(iter(allowed[1]))
    # The penalised row: the best allowed token of the penalised logits.
    penalised = masked[3].clone()
    for t in prompt + output:
        penalised[t] = penalised[t] / 1.5 if penalised[t] > 0 else penalised[t] * 1.5
    assert tokens[3] == penalised.argmax().item()
    # The seeded random row draws what the same row on masked logits draws; free rows are unchanged.
    ref = Sampler().sample(masked, rows())
    assert tokens[2] == ref.token_ids[2].item()
    free = Sampler().sample(logits, rows())
    assert tokens[4:] == free.token_ids[4:].tolist()
    # Logprobs are the model's: log-softmax of the raw logits, whatever the mask allowed (row 0
    # asked for them; its top tokens need not be allowed ones).
    raw = logits.double().log_softmax(-1)
    assert abs(out.logprobs[0].item() - raw[0, tokens[0]].item()) < 1e-5
    values, ids = raw[0].topk(2)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert max(abs(a - b) for (_, a), b in zip(out.top_logprobs[0], values.tolist())) < 1e-5
