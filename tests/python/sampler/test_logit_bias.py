"""logit_bias, allowed_token_ids and bad_words: the sampler's rules against a plain per-row
torch reference over many rows, and the engine on a tiny random Llama against a greedy loop
over transformers' logits with the same rules; bad requests raise ValueError and leave the
engine serving."""

from __future__ import annotations

import random

import pytest
import torch

from model_fixtures import TINY_VOCAB, save_tiny_model
from vpage import LLM, SamplingParams
from vpage.sampler import Sampler, SamplingRow, apply_penalties, apply_token_controls, make_generator

PROMPTS = [[5, 9, 17], list(range(10, 40)), [42] * 9]
STEPS = 8


# ----------------------------------------------------------------- sampler against a reference

def _controls_reference(logits: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    """One row, the rules written out plainly (float64): allowed, bad words, bias."""
    out = logits.double().clone()
    if params.allowed_token_ids:
        keep = torch.zeros_like(out, dtype=torch.bool)
        keep[params.allowed_token_ids] = True
        out[~keep] = float("-inf")
    for word in params.bad_words_token_ids:
        if len(word) == 1 or output[len(output) - len(word) + 1:] == word[:-1]:
            out[word[-1]] = float("-inf")
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    return out


def _random_row(rng: random.Random, vocab: int) -> SamplingRow:
    output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
    kwargs: dict = {"temperature": 0.0} if rng.random() < 0.5 else {"temperature": 0.8, "seed": rng.randrange(99)}
    if rng.random() < 0.6:
        kwargs["logit_bias"] = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 40))}
    if rng.random() < 0.4:
        kwargs["allowed_token_ids"] = rng.sample(range(vocab), rng.randrange(1, 30))
    if rng.random() < 0.3:
        kwargs["repetition_penalty"] = 1.5
    params = SamplingParams(max_tokens=4, **kwargs)
    if rng.random() < 0.6:  # bad words as token sequences: some end where the output ends
        words = [[rng.randrange(vocab)] for _ in range(rng.randrange(0, 3))]
        if output:
            words.append(output[-2:] + [rng.randrange(vocab)])
        words.append([rng.randrange(vocab), rng.randrange(vocab)])
        params._bad_words_token_ids = words
    generator = make_generator(params.seed) if params.seed is not None else None
    return SamplingRow(params, [1, 2, 3], output, generator)


def test_token_controls_equal_the_reference_over_256_rows():
    rng = random.Random(0)
    vocab = 997
    rows = [_random_row(rng, vocab) for _ in range(256)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(1)) * 4
    which = [i for i, r in enumerate(rows) if r.params.logit_bias or r.params.allowed_token_ids
             or r.params.bad_words_token_ids]
    assert len(which) > 150
    got = logits.clone()
    apply_token_controls(got, rows, which)
    for i, row in enumerate(rows):
        expected = _controls_reference(logits[i], row.params, list(row.output_token_ids)) if i in which else logits[i]
        torch.testing.assert_close(got[i].double(), expected.double(), rtol=0, atol=1e-4)

    out = Sampler().sample(logits, rows)
    for i, row in enumerate(rows):
        expected = _controls_reference(logits[i], row.params, list(row.output_token_ids))
        if row.params.repetition_penalty != 1.0:
            penalised = expected.float()[None]
            apply_penalties(penalised, [row])
            expected = penalised[0].double()
        token = int(out.token_ids[i])
        assert torch.isfinite(expected[token]), i  # never a banned or disallowed token
        if row.params.temperature == 0:
            assert token == int(expected.argmax()), i
    # The model's own logprobs, not the biased ones (rows that asked for none get NaN).
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    assert not asked and torch.isnan(out.logprobs).all()


def test_sampled_tokens_follow_the_biased_distribution():
    # 4000 seeded draws from one row: the bias shifts probability exactly as softmax(logits + bias).
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5, 2.0]])
    params = SamplingParams(temperature=1.0, seed=3, logit_bias={2: 3.0, 4: -2.0}, allowed_token_ids=[0, 2, 3, 4])
    row = SamplingRow(params, [0], [], make_generator(3))
    counts = torch.zeros(5)
    sampler = Sampler()
    for _ in range(4000):
        counts[int(sampler.sample(logits, [row]).token_ids[0])] += 1
    expected = torch.tensor([[1.0, float("-inf"), 2.0, 0.5, 0.0]]).softmax(-1)[0]
    assert counts[1] == 0
    assert torch.allclose(counts / 4000, expected, atol=0.03)


def test_logprobs_are_the_models_not_the_biased_ones():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=0, logprobs=3, logit_bias={7: 100.0}, allowed_token_ids=[7, 8])
    out = Sampler().sample(logits, [SamplingRow(params, [1], [])] * 3)
    reference = logits.log_softmax(-1)
    assert out.token_ids.tolist() == [7, 7, 7]
    torch.testing.assert_close(out.logprobs, reference[:, 7])
    for i, top in enumerate(out.top_logprobs):
        values, ids = reference[i].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: True}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids is empty"),
    ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids"),
    ({"bad_words": ["ok", "  "]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"use_beam_search": True, "n": 2, "temperature": 0, "logit_bias": {1: 1.0}}, "beam search"),
])
def test_invalid_controls(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# ----------------------------------------------------------------- engine against transformers

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    hf = save_tiny_model("llama", folder, seed=3)
    return LLM(str(folder), dtype="float32", kv_cache_memory=0.01, block_size=8), hf


def _hf_greedy(hf, prompt: list[int], rule) -> list[int]:
    """STEPS greedy tokens of transformers' model with ``rule(logits, generated)`` applied to
    each step's float64 logits first."""
    ids, generated = list(prompt), []
    for _ in range(STEPS):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        token = int(rule(logits, generated).argmax())
        generated.append(token)
        ids.append(token)
    return generated


def _generate(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_bias_and_allowed_tokens_match_transformers(tiny):
    llm, hf = tiny
    rng = random.Random(7)
    bias = {rng.randrange(TINY_VOCAB): rng.uniform(-8, 8) for _ in range(60)}
    allowed = rng.sample(range(TINY_VOCAB), 12)
    for kwargs in ({"logit_bias": bias}, {"allowed_token_ids": allowed},
                   {"logit_bias": bias, "allowed_token_ids": allowed}):
        params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **kwargs)
        expected = [_hf_greedy(hf, p, lambda x, g: _controls_reference(x, params, g)) for p in PROMPTS]
        assert _generate(llm, params) == expected, kwargs


def test_a_large_bias_forces_a_token_and_minus_100_bans_the_argmax(tiny):
    llm, _ = tiny
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=2),
                         use_tqdm=False)
    forced = _generate(llm, SamplingParams(temperature=0.9, seed=1, max_tokens=STEPS, ignore_eos=True,
                                           logit_bias={123: 100.0}))
    assert forced == [[123] * STEPS] * len(PROMPTS)
    for prompt, out in zip(PROMPTS, plain):
        first = out.outputs[0].token_ids[0]
        runner_up = [t for t, lp in out.outputs[0].logprobs[0].items() if lp.rank == 2][0]
        banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=2,
                                                       logit_bias={first: -100.0}), use_tqdm=False)[0].outputs[0]
        assert banned.token_ids == [runner_up]
        # The reported logprobs are the model's own: the same as without the bias.
        assert {t: lp.logprob for t, lp in banned.logprobs[0].items()} == pytest.approx(
            {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}, abs=1e-5)


def test_allowed_token_ids_restrict_random_samples(tiny):
    llm, _ = tiny
    allowed = [3, 50, 77, 101, 230, 311]
    params = SamplingParams(temperature=1.5, seed=11, n=3, max_tokens=STEPS, ignore_eos=True,
                            allowed_token_ids=allowed)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [t for o in outs for c in o.outputs for t in c.token_ids]
    assert len(tokens) == len(PROMPTS) * 3 * STEPS and set(tokens) <= set(allowed)
    assert len(set(tokens)) > 2  # really sampled, not one forced token
    again = llm.generate(PROMPTS, params, use_tqdm=False)  # seeded: the same draws
    assert [[c.token_ids for c in o.outputs] for o in again] == [[c.token_ids for c in o.outputs] for o in outs]


def _contains(tokens: list[int], window: list[int]) -> bool:
    return any(tokens[i:i + len(window)] == window for i in range(len(tokens) - len(window) + 1))


def test_bad_words_are_never_completed(tiny):
    llm, hf = tiny
    tokenizer = llm.get_tokenizer()
    prompt = PROMPTS[1]
    greedy = _generate(llm, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True), [prompt])[0]
    # A two-token word greedy decoding writes (after its first token), and a one-token word.
    found = [(greedy[i:i + 2], text) for i in range(1, len(greedy) - 1)
             for text in (tokenizer.decode(greedy[i:i + 2]),) if text.strip()
             and tokenizer.encode(text, add_special_tokens=False) == greedy[i:i + 2]]
    assert found, "no two-token word in the greedy output to ban"
    window, word = found[0]
    single = tokenizer.decode([greedy[0]])
    assert tokenizer.encode(single.lstrip(), add_special_tokens=False) == [greedy[0]]
    for words, banned in (([word], window), ([single.lstrip()], [greedy[0]])):
        params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, bad_words=words)
        got = _generate(llm, params, [prompt])[0]
        assert not _contains(got, banned) and got != greedy
        params.update_from_tokenizer(tokenizer)
        assert banned in params.bad_words_token_ids
        assert got == _hf_greedy(hf, prompt, lambda x, g: _controls_reference(x, params, g))


def test_out_of_vocabulary_ids_are_refused_and_the_engine_keeps_serving(tiny):
    llm, _ = tiny
    engine = llm.engine
    cases = [(SamplingParams(logit_bias={5: 1.0, TINY_VOCAB + 4: 2.0}), f"[{TINY_VOCAB + 4}] in logit_bias"),
             (SamplingParams(allowed_token_ids=[1, TINY_VOCAB, 10**6]),
              f"[{TINY_VOCAB}, 1000000] in allowed_token_ids")]
    for params, message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            engine.add_request("bad", [5, 6], params)
        assert not engine.has_unfinished_requests()
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    assert _generate(llm, params, PROMPTS[:1]) == _generate(llm, params, PROMPTS[:1])
    assert engine.scheduler.usage().free_gpu_blocks == engine.scheduler.usage().num_gpu_blocks
