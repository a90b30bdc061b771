"""vpage.ops' token-bitmask ops (apply_token_bitmask_, logsumexp_argmax(bitmask=...)) against
plain torch references: random logits and masks, awkward vocab sizes (1 to 151936, wider
bitmasks with stray bits past the vocabulary), strided rows, rows allowing every token, none or
one, NaN/inf entries, 1 and 2 threads, padding that must stay untouched, and outputs poisoned
before the kernel writes them. The CUDA cases (marked ``cuda``) compare the GPU with the same
references and run where a GPU is present (bench/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from vpage import _ops_cpu, ops

try:
    from vpage import _cuda
except ImportError:
    _cuda = None

VOCABS = [1, 31, 32, 33, 1000, 49152, 151936]


def torch_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab]: bit t % 32 of word t // 32 of each row."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~torch_allowed(bitmask, logits.shape[1]), float("-inf"))


def reference_argmax(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """torch's argmax over the allowed tokens; 0 for a row allowing none."""
    allowed = torch_allowed(bitmask, logits.shape[1])
    return logits.masked_fill(~allowed, float("-inf")).argmax(-1).masked_fill_(~allowed.any(-1), 0)


def make_bitmask(rows: int, vocab: int, gen: torch.Generator, extra_words: int = 0) -> torch.Tensor:
    """Random words; row 0 allows every token, row 1 none, row 2 one token, row 3 a run of
    zero words then ones (when there are so many rows); bits past vocab are random."""
    words = ops.token_bitmask_words(vocab) + extra_words
    bitmask = torch.randint(-2**31, 2**31, (rows, words), dtype=torch.int64, generator=gen).to(torch.int32)
    special = [torch.full((words,), -1, dtype=torch.int32), torch.zeros(words, dtype=torch.int32)]
    one = bitmask[0].clone() & 0
    token = int(torch.randint(0, vocab, (1,), generator=gen))
    one[token // 32] = -2**31 if token % 32 == 31 else 1 << (token % 32)
    special.append(one)
    runs = torch.full((words,), -1, dtype=torch.int32)
    runs[: words // 2] = 0
    special.append(runs)
    for r, row in enumerate(special[:rows]):
        bitmask[r] = row
    stray = torch.randint(-2**31, 2**31, (rows,), dtype=torch.int64, generator=gen).to(torch.int32)
    if vocab % 32:  # the bits past the vocabulary in the last word: random except in row 1
        tail = ops.token_bitmask_words(vocab) - 1
        keep = (1 << (vocab % 32)) - 1
        bitmask[:, tail] = (bitmask[:, tail] & keep) | (stray & ~keep)
        if rows > 1:
            bitmask[1, tail] = stray[1] & ~keep
    return bitmask


def random_logits(rows: int, vocab: int, gen: torch.Generator, pad: int = 0) -> torch.Tensor:
    """[rows, vocab] view of rows vocab + pad apart; the padding holds a sentinel."""
    base = torch.full((rows, vocab + pad), 1234.5)
    base[:, :vocab] = torch.randn(rows, vocab, generator=gen) * 4 + 0.25
    return base[:, :vocab]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    previous = ops.get_num_threads()
    ops.set_num_threads(request.param)
    yield request.param
    ops.set_num_threads(previous)


def check_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    before = logits.clone()
    storage = logits.as_strided((logits.shape[0], logits.stride(0)), (logits.stride(0), 1)).clone() \
        if logits.shape[0] and logits.stride(0) > logits.shape[1] else None
    ops.apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, reference_apply(before, bitmask))
    if storage is not None:  # the padding between rows is untouched
        after = logits.as_strided((logits.shape[0], logits.stride(0)), (logits.stride(0), 1))
        assert torch.equal(after[:-1, logits.shape[1]:], storage[:-1, logits.shape[1]:])


def check_argmax(logits: torch.Tensor, bitmask: torch.Tensor, want=None) -> None:
    log_norm, argmax = ops.logsumexp_argmax(logits, want, bitmask=bitmask)
    assert argmax.dtype == torch.int64 and log_norm.dtype == torch.float32
    assert torch.equal(argmax, reference_argmax(logits, bitmask))
    ref = torch.logsumexp(logits.double(), dim=-1)  # the whole row's, whatever the mask
    if want is not None:
        ref = ref.masked_fill(~want, float("nan"))
    assert torch.equal(torch.isnan(log_norm), torch.isnan(ref))
    finite = torch.isfinite(ref)
    assert torch.equal(log_norm[~finite & ~ref.isnan()].double(), ref[~finite & ~ref.isnan()])
    err = (log_norm[finite].double() - ref[finite]).abs()
    assert (err <= 1e-6 * ref[finite].abs().clamp_min(1.0)).all(), f"max error {err.max().item()}"


@pytest.mark.parametrize("vocab", VOCABS)
def test_apply_matches_torch(vocab, threads):
    gen = torch.Generator().manual_seed(vocab)
    rows = 6 if vocab < 100000 else 4
    check_apply(random_logits(rows, vocab, gen), make_bitmask(rows, vocab, gen))
    check_apply(random_logits(rows, vocab, gen, pad=7), make_bitmask(rows, vocab, gen, extra_words=3))


@pytest.mark.parametrize("vocab", VOCABS)
def test_masked_argmax_matches_torch(vocab, threads):
    gen = torch.Generator().manual_seed(vocab + 1)
    rows = 6 if vocab < 100000 else 4
    check_argmax(random_logits(rows, vocab, gen), make_bitmask(rows, vocab, gen))
    check_argmax(random_logits(rows, vocab, gen, pad=5), make_bitmask(rows, vocab, gen, extra_words=2))


def test_masked_argmax_ties_nan_and_inf():
    """Ties among allowed tokens (the first wins, a larger disallowed value loses), NaN and
    +-inf at allowed and disallowed positions, a row whose allowed tokens are all -inf."""
    gen = torch.Generator().manual_seed(3)
    vocab = 1000
    x = torch.randint(0, 4, (8, vocab), generator=gen).float() - 0.5  # many equal values
    bitmask = make_bitmask(8, vocab, gen)
    bitmask[4:] = torch.randint(-2**31, 2**31, (4, bitmask.shape[1]), dtype=torch.int64,
                                generator=gen).to(torch.int32)
    allowed = torch_allowed(bitmask, vocab)
    x[4, ~allowed[4]] = 100.0  # larger values only where disallowed
    x[5, 700] = float("nan")  # a NaN wherever bit 700 says
    x[5, 10] = float("inf")
    x[6, allowed[6]] = float("-inf")  # allowed tokens all -inf: token 0 as torch
    x[7, 3], x[7, 900] = float("nan"), float("nan")
    check_argmax(x, bitmask)
    for row in (5, 7):  # both kinds of NaN position, every allowed one
        x[row] = torch.randn(vocab, generator=gen)
        first_allowed = int(allowed[row].nonzero()[0])
        x[row, first_allowed + 1:] = torch.where(allowed[row, first_allowed + 1:], float("nan"), 1e9)
    check_argmax(x, bitmask)
    applied = x.clone()
    ops.apply_token_bitmask_(applied, bitmask)  # NaN kept where allowed, -inf where not
    assert torch.equal(applied.isnan(), x.isnan() & allowed)
    assert torch.equal(applied[~allowed], torch.full_like(applied[~allowed], float("-inf")))


def test_masked_argmax_want_log_norm_and_strided():
    gen = torch.Generator().manual_seed(5)
    vocab = 4099
    base = torch.randn(12, vocab + 9, generator=gen) * 3
    bitmask = make_bitmask(6, vocab, gen)
    want = torch.tensor([True, False, True, False, False, True])
    check_argmax(base[::2, :vocab], bitmask, want)  # rows 2 (vocab + 9) apart
    check_argmax(base[:6, 3:vocab + 3], bitmask)
    columns = torch.randn(vocab, 6, generator=gen).t()  # strided columns: the torch path
    check_argmax(columns, bitmask, want)
    with pytest.raises(ValueError, match="contiguous columns"):
        ops.apply_token_bitmask_(columns, bitmask)


def test_kernel_writes_every_row_of_poisoned_outputs():
    gen = torch.Generator().manual_seed(11)
    vocab, rows = 777, 9
    logits = random_logits(rows, vocab, gen, pad=3)
    bitmask = make_bitmask(rows, vocab, gen, extra_words=1)
    log_norm = torch.full((rows,), float("nan"))
    argmax = torch.full((rows,), -7, dtype=torch.int64)
    _ops_cpu.logsumexp_argmax(logits, log_norm, argmax, None, bitmask)
    assert torch.equal(argmax, reference_argmax(logits, bitmask))
    assert torch.allclose(log_norm.double(), torch.logsumexp(logits.double(), -1), rtol=1e-6, atol=0)


def test_rows_allowing_every_token_match_the_unmasked_op():
    gen = torch.Generator().manual_seed(13)
    for vocab in (33, 49152):
        x = torch.randn(5, vocab, generator=gen)
        ones = torch.full((5, ops.token_bitmask_words(vocab)), -1, dtype=torch.int32)
        log_norm, argmax = ops.logsumexp_argmax(x, bitmask=ones)
        plain_norm, plain_argmax = ops.logsumexp_argmax(x)
        assert torch.equal(argmax, plain_argmax) and torch.equal(log_norm, plain_norm)


def test_bad_arguments_and_empty_batch():
    x = torch.randn(3, 100)
    good = torch.full((3, 4), -1, dtype=torch.int32)
    for bad, error in [(good.long(), TypeError), (good[:2], ValueError), (good[:, :3], ValueError),
                       (good[:, ::2], ValueError), (good[0], ValueError)]:
        with pytest.raises(error):
            ops.apply_token_bitmask_(x, bad)
        with pytest.raises(error):
            ops.logsumexp_argmax(x, bitmask=bad)
    with pytest.raises(TypeError):
        ops.apply_token_bitmask_(x.double(), good)
    empty = torch.randn(0, 100)
    ops.apply_token_bitmask_(empty, good[:0])
    log_norm, argmax = ops.logsumexp_argmax(empty, bitmask=good[:0])
    assert log_norm.shape == argmax.shape == (0,)


# ---------------------------------------------------------------------------------------
# CUDA: the same references on the GPU (skipped without one).


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and _cuda is not None and _cuda.is_available()


def requires_cuda(test):
    """Marks `test` as a CUDA test, skipped where there is no GPU or no vpage._cuda."""
    skip = pytest.mark.skipif(not _cuda_ready(), reason="needs an NVIDIA GPU and vpage._cuda")
    return pytest.mark.cuda(skip(test))


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@requires_cuda
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [1, 7])
def test_cuda_apply_and_masked_argmax(vocab, rows):
    gen = torch.Generator().manual_seed(vocab * 3 + rows)
    logits = random_logits(rows, vocab, gen)
    if vocab > 40:
        logits[-1, 40] = float("nan")  # kept where allowed, -inf where not
    bitmask = make_bitmask(rows, vocab, gen, extra_words=1)
    padded = torch.full((rows, vocab + 5), 1234.5, device="cuda")
    device_logits = padded[:, :vocab]  # rows vocab + 5 apart
    device_logits.copy_(logits)
    device_bitmask = bitmask.cuda()
    log_norm, argmax = ops.logsumexp_argmax(device_logits, bitmask=device_bitmask)
    assert argmax.is_cuda and torch.equal(argmax.cpu(), reference_argmax(logits, bitmask))
    ref = torch.logsumexp(logits.double(), -1)
    torch.testing.assert_close(log_norm.cpu().double(), ref, rtol=1e-5, atol=0, equal_nan=True)
    ops.apply_token_bitmask_(device_logits, device_bitmask)
    assert_same(device_logits.cpu(), reference_apply(logits, bitmask))
    assert (padded[:, vocab:].cpu() == 1234.5).all()  # the padding is untouched


@requires_cuda
def test_cuda_many_rows_and_bad_sizes():
    """More rows than the kernel's grid holds in y (65535): the rows loop over the grid."""
    gen = torch.Generator().manual_seed(17)
    rows, vocab = 70000, 40
    logits = torch.randn(rows, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31, (rows, 2), dtype=torch.int64, generator=gen).to(torch.int32)
    device_logits = logits.cuda()
    ops.apply_token_bitmask_(device_logits, bitmask.cuda())
    assert_same(device_logits.cpu(), reference_apply(logits, bitmask))
    with pytest.raises(RuntimeError, match="apply_token_bitmask"):
        _cuda.apply_token_bitmask(logits=device_logits.data_ptr(), num_rows=rows, vocab=vocab, row_stride=vocab,
                                  bitmask=0, bitmask_stride=1, stream=torch.cuda.current_stream().cuda_stream)
