"""vpage.ops.logsumexp_argmax (the sampler's fused row statistics) against float64 torch:
awkward vocab sizes, -inf entries, ties (the first maximum, like torch.argmax), inf/NaN rows,
strided rows, rows that want only the argmax, and the greedy tokens of Sampler.sample equal to torch's argmax."""

import pytest
import torch

from vpage import ops
from vpage.sampler import Sampler, SamplingRow
from vpage.sampling_params import SamplingParams


def check(x: torch.Tensor) -> None:
    log_norm, argmax = ops.logsumexp_argmax(x)
    assert log_norm.dtype == torch.float32 and argmax.dtype == torch.int64
    assert torch.equal(argmax, x.argmax(dim=-1))
    ref = torch.logsumexp(x.double(), dim=-1)
    assert torch.equal(torch.isnan(log_norm), torch.isnan(ref))
    finite = torch.isfinite(ref)
    infinite = ~finite & ~torch.isnan(ref)
    assert torch.equal(log_norm[infinite].double(), ref[infinite])
    err = (log_norm[finite].double() - ref[finite]).abs()
    assert (err <= 1e-6 * ref[finite].abs().clamp_min(1.0)).all(), f"max error {err.max().item()}"


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("vocab", [1, 7, 15, 16, 17, 63, 65, 1000, 49153])
def test_matches_float64_torch(rows, vocab):
    gen = torch.Generator().manual_seed(vocab * 31 + rows)
    x = torch.randn(rows, vocab, generator=gen) * 8
    check(x)
    x[:, ::3] = float("-inf")  # -inf entries (the first one too)
    check(x)
    ties = torch.randint(0, 3, (rows, vocab), generator=gen).float()  # many equal maxima
    check(ties)


def test_ties_pick_the_first_maximum():
    x = torch.zeros(2, 300)
    x[0, 130] = x[0, 131] = x[0, 299] = 5.0
    x[1, 299] = x[1, 64] = 1.0
    assert ops.logsumexp_argmax(x)[1].tolist() == [130, 64]


def test_infinite_and_nan_rows():
    x = torch.full((5, 40), float("-inf"))  # row 0: all -inf -> -inf, index 0 like torch
    x[1, 5] = float("inf")
    x[2, 7], x[2, 9] = float("nan"), 100.0
    x[3, 30], x[3, 3] = float("nan"), float("inf")
    x[4] = torch.linspace(-3, 3, 40)
    x[4, 33] = float("nan")
    check(x)


@pytest.mark.parametrize("vocab", [1, 17, 1000, 49153])
def test_rows_left_out_of_want_log_norm_get_the_argmax_only(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=gen) * 4
    x[1] = float("-inf")
    x[2, vocab // 2] = float("nan")
    x[3, vocab - 1] = float("inf")
    want = torch.tensor([True, False, False, False, True, False, True, False, False])
    log_norm, argmax = ops.logsumexp_argmax(x, want)
    assert torch.equal(argmax, x.argmax(dim=-1))  # every row, NaN and inf rows included
    full, _ = ops.logsumexp_argmax(x)
    assert torch.equal(log_norm[want], full[want]) and log_norm[~want].isnan().all()
    with pytest.raises(ValueError):
        ops.logsumexp_argmax(x, want[:3])


def test_strided_rows_and_empty_batch():
    base = torch.randn(6, 50)
    check(base[:, :37])
    check(base[::2])
    log_norm, argmax = ops.logsumexp_argmax(torch.zeros(0, 10))
    assert log_norm.shape == argmax.shape == (0,)
    with pytest.raises(TypeError):
        ops.logsumexp_argmax(base.double())
    with pytest.raises(ValueError):
        ops.logsumexp_argmax(base[0])


def test_sampler_greedy_tokens_equal_torch_argmax():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(9, 1001, generator=gen)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie
    greedy, with_logprobs = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=0)
    rows = [SamplingRow(with_logprobs if i % 3 else greedy, [1, 2], []) for i in range(9)]
    rows[5].banned_token_ids = [int(logits[5].argmax())]  # a row whose argmax the ban changes
    out = Sampler().sample(logits, rows)
    expected = logits.argmax(dim=-1)
    expected[5] = logits[5].clone().index_fill_(0, torch.tensor(rows[5].banned_token_ids), float("-inf")).argmax()
    assert torch.equal(out.token_ids, expected)
    ref = logits.double().log_softmax(dim=-1).gather(1, expected[:, None])[:, 0]
    asked = torch.tensor([i % 3 != 0 for i in range(9)])
    assert torch.allclose(out.logprobs.double()[asked], ref[asked], atol=2e-6)
    assert out.logprobs[~asked].isnan().all()  # rows that need no logprob skip the normaliser
