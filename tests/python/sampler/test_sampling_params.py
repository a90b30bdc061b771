"""SamplingParams: defaults, normalisation and validation errors."""

from __future__ import annotations

import pytest

from vpage.sampling_params import SamplingParams, SamplingType


def test_defaults_and_normalisation():
    p = SamplingParams(n=2, stop="###", top_k=0)
    assert p.best_of == 2 and p.stop == ["###"] and p.stop_token_ids == [] and p.top_k == -1
    assert p.max_tokens == 16 and p.sampling_type == SamplingType.RANDOM


def test_sampling_types():
    assert SamplingParams(temperature=0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    beam = SamplingParams(use_beam_search=True, best_of=4, temperature=0, length_penalty=0.7, early_stopping="never")
    assert beam.sampling_type == SamplingType.BEAM


def test_greedy_resets_truncation():
    p = SamplingParams(temperature=0, top_p=0.5, top_k=5, min_p=0.2)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n=0), "n must be at least 1"),
        (dict(n=3, best_of=2), "best_of must be greater than or equal to n"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=["ok", ""]), "stop strings"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed="x"), "seed"),
        (dict(temperature=0, n=2), "best_of must be 1 when using greedy"),
        (dict(length_penalty=0.5), "length_penalty"),
        (dict(early_stopping=True), "early_stopping"),
        (dict(use_beam_search=True, best_of=1, temperature=0), "best_of must be greater than 1"),
        (dict(use_beam_search=True, best_of=2, temperature=0.5), "temperature must be 0"),
        (dict(use_beam_search=True, best_of=2, temperature=0, top_k=3), "top_k"),
        (dict(use_beam_search=True, best_of=2, temperature=0, early_stopping="sometimes"), "early_stopping"),
    ],
)
def test_invalid(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
