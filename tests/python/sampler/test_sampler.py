"""Sampler: greedy, truncation masks, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from vpage.sampler import (Sampler, SamplingRow, apply_min_p, apply_penalties, apply_top_k_top_p, make_generator,
                           sample_from_probs)
from vpage.sampling_params import SamplingParams

VOCAB = 50


def rows_for(params: list[SamplingParams], seeds: list[int | None] | None = None) -> list[SamplingRow]:
    seeds = seeds or [None] * len(params)
    return [SamplingRow(p, [1, 2], [], None if s is None else make_generator(s)) for p, s in zip(params, seeds)]


def random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprobs():
    logits = random_logits(4)
    params = [SamplingParams(temperature=0, logprobs=3)] * 4
    out = Sampler().sample(logits, rows_for(params))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, ref.max(-1).values)
    for i, top in enumerate(out.top_logprobs):
        values, ids = ref[i].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)


def test_logits_not_modified():
    logits = random_logits(2)
    before = logits.clone()
    Sampler().sample(logits, rows_for([SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.3)] * 2))
    assert torch.equal(logits, before)


def test_top_k_mask():
    logits = random_logits(3)
    masked = logits.clone()
    apply_top_k_top_p(masked, torch.tensor([1, 5, VOCAB]), torch.ones(3))
    for row, k in zip(range(3), [1, 5, VOCAB]):
        kept = torch.isfinite(masked[row]).nonzero().flatten()
        assert set(kept.tolist()) == set(logits[row].topk(k).indices.tolist())


def test_top_p_mask_keeps_smallest_covering_set():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.9, 0.03, 0.02]])
    logits = probs.log()
    apply_top_k_top_p(logits, torch.tensor([4, 4]), torch.tensor([0.75, 0.5]))
    assert torch.isfinite(logits).tolist() == [[True, True, False, False], [False, True, False, False]]


def test_min_p_mask():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    apply_min_p(logits, torch.tensor([0.35]))  # threshold 0.175
    assert torch.isfinite(logits).tolist() == [[True, True, False, False]]


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    row = SamplingRow(
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        prompt_token_ids=[0, 1],
        output_token_ids=[3, 3, 1],
    )
    apply_penalties(logits, [row])
    expected = [
        2.0 / 2,  # prompt token: repetition only
        -1.0 * 2 - 0.5 * 1 - 0.25,  # prompt and output once
        0.5,  # unseen
        3.0 / 2 - 0.5 * 2 - 0.25,  # output twice
        -2.0,  # unseen
    ]
    assert logits[0].tolist() == pytest.approx(expected)


def test_banned_tokens_are_never_picked():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 100.0
    logits[:, 9] = 50.0
    banned = SamplingRow(SamplingParams(temperature=0), [1], [4], banned_token_ids=[7, 9])
    free = SamplingRow(SamplingParams(temperature=0), [1], [4])
    out = Sampler().sample(logits, [banned, free])
    assert out.token_ids.tolist()[1] == 7 and out.token_ids.tolist()[0] not in (7, 9)
    random_row = SamplingRow(SamplingParams(temperature=1.0, seed=3), [1], [], make_generator(3), banned_token_ids=[7])
    assert all(Sampler().sample(logits[:1], [random_row]).token_ids.item() != 7 for _ in range(20))


def test_random_sampling_respects_masks_and_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]]))
    sampler = Sampler()
    counts = torch.zeros(4)
    gen = make_generator(0)
    rows = [SamplingRow(SamplingParams(top_k=2), [], [], gen)]
    for _ in range(2000):
        counts[sampler.sample(logits, rows).token_ids[0]] += 1
    assert counts[2] == 0 and counts[3] == 0
    assert counts[0] / 2000 == pytest.approx(2 / 3, abs=0.04)


def test_inverse_cdf_sampling_matches_the_distribution():
    # Rows with zeros (never picked), one certain token, a near-uniform large vocabulary, and
    # probabilities summing a little below 1 (the last token stays reachable, nothing past it).
    probs = torch.zeros(4, 1000)
    probs[0, [3, 500, 999]] = torch.tensor([0.5, 0.3, 0.2])
    probs[1, 7] = 1.0
    probs[2] = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 0.1, -1)
    probs[3, [0, 999]] = torch.tensor([0.2, 0.7999])
    draws = 20000
    counts = torch.zeros(4, 1000)
    for chunk in range(draws // 500):
        generators = [make_generator(chunk), None, make_generator(10_000 + chunk), None]
        for _ in range(500):
            picked = sample_from_probs(probs, generators)
            counts[torch.arange(4), picked] += 1
    assert set(counts[0].nonzero()[:, 0].tolist()) == {3, 500, 999} and counts[1, 7] == draws
    assert set(counts[3].nonzero()[:, 0].tolist()) == {0, 999}
    for row in (0, 2, 3):  # chi-square against the normalised row, 0.999 quantile
        expected = probs[row] / probs[row].sum() * draws
        keep = expected > 0
        chi2 = float(((counts[row, keep] - expected[keep]) ** 2 / expected[keep]).sum())
        dof = int(keep.sum()) - 1
        assert chi2 < dof + 3.1 * math.sqrt(2 * dof) + 10, (row, chi2, dof)


def test_seeded_inverse_cdf_sampling_repeats():
    probs = torch.softmax(random_logits(3), -1)
    first = [sample_from_probs(probs, [make_generator(7), None, make_generator(8)]) for _ in range(3)]
    again = [sample_from_probs(probs, [make_generator(7), None, make_generator(8)]) for _ in range(3)]
    assert all(a[0] == b[0] and a[2] == b[2] for a, b in zip(first, again))


def test_seeded_rows_independent_of_batch():
    target = SamplingParams(temperature=0.9, top_p=0.9, seed=1234)
    logits = random_logits(1, seed=5)

    def draw(extra: int) -> list[int]:
        sampler = Sampler()
        gen = make_generator(1234)
        others = [
            SamplingParams(temperature=1.0, seed=s) if s % 2 else SamplingParams(temperature=0.5)
            for s in range(extra)
        ]
        tokens = []
        for step in range(20):
            batch = torch.cat([random_logits(extra, seed=100 + step), logits]) if extra else logits
            rows = rows_for(others, [p.seed for p in others]) + [SamplingRow(target, [], tokens, gen)]
            tokens.append(int(sampler.sample(batch, rows).token_ids[-1]))
        return tokens

    alone = draw(0)
    assert draw(3) == alone and draw(6) == alone
    assert len(set(alone)) > 1


def test_beam_rows_get_candidates():
    logits = random_logits(1)
    params = SamplingParams(use_beam_search=True, best_of=3, temperature=0)
    out = Sampler().sample(logits, rows_for([params]))
    assert len(out.top_logprobs[0]) == 6 and out.top_logprobs[0][0][0] == int(logits.argmax())
    assert math.isclose(out.top_logprobs[0][0][1], float(out.logprobs[0]), abs_tol=1e-6)


def test_seeded_row_needs_generator():
    with pytest.raises(ValueError, match="row 0 has seed 7 but no generator"):
        Sampler().sample(random_logits(1), [SamplingRow(SamplingParams(seed=7), [], [])])
