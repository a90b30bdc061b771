"""vpage.ops.pack_dense_weight / dense_matmul / dense_rows and the layers that pack their
weights (Linear, the embeddings): against a float64 matmul of the same values on random
inputs and awkward sizes, every weight dtype and activation dtype; strided x and out rows;
lookups in a packed table equal the table's rows; bad arguments raise before any kernel runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vpage import ops
from vpage.model_executor.layers.linear import Embedding, Linear, pack_dense_weights
from vpage.model_executor.layers.vocab_parallel import VocabParallelEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_EPS = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _check_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None) -> None:
    """|got - x @ w.T (+ bias)| within float32 accumulation over k plus the output's rounding."""
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    if bias is not None:
        exact += bias.double()
        magnitude += bias.double().abs()
    bound = (x.shape[1] + 2) * 1.2e-7 * magnitude + _EPS[got.dtype] * exact.abs() + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 33, 257), (7, 64, 100), (40, 5, 1), (130, 97, 300)])
def test_dense_matmul_matches_float64(weight_dtype, dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).to(weight_dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    packed = ops.pack_dense_weight(w)
    assert packed.shape == (-(-n // 32), k, 32) and packed.dtype == weight_dtype
    out = ops.dense_matmul(x, packed, n, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    _check_close(out, x, w, bias)
    _check_close(ops.dense_matmul(x, packed, n), x, w)


@pytest.mark.parametrize("weight_dtype", DTYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 70, 300), (13, 45, 129), (260, 64, 64)])
def test_float32_out_of_16_bit_x(weight_dtype, dtype, m, n, k):
    """A 16-bit model's logits: float32 outputs, which rounded to x's dtype are its outputs."""
    gen = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(n, k, generator=gen).to(weight_dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    packed = ops.pack_dense_weight(w)
    for bias in (None, torch.randn(n, generator=gen)):
        out = ops.dense_matmul(x, packed, n, bias, out_dtype=torch.float32)
        assert out.dtype == torch.float32 and out.shape == (m, n)
        _check_close(out, x, w, bias)
        assert torch.equal(out.to(dtype), ops.dense_matmul(x, packed, n, bias))
        into = torch.full((m, n), float("nan"))
        assert ops.dense_matmul(x, packed, n, bias, out=into).data_ptr() == into.data_ptr()
        assert torch.equal(into, out)


def test_strided_rows_and_out_buffer():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(70, 48, generator=gen)
    wide = torch.randn(9, 64, generator=gen)
    x = wide[:, 8:56]  # rows 64 apart
    out = torch.full((9, 80), float("nan"))[:, :70]
    result = ops.dense_matmul(x, ops.pack_dense_weight(w), 70, out=out)
    assert result.data_ptr() == out.data_ptr()
    _check_close(out, x, w)
    assert torch.isnan(out.as_strided((9, 10), (80, 1), out.storage_offset() + 70)).all()  # untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_rows_are_the_weight_rows(dtype):
    w = torch.randn(45, 19).to(dtype)
    ids = torch.tensor([0, 44, 31, 32, 7, 7])
    assert torch.equal(ops.dense_rows(ops.pack_dense_weight(w), ids), w[ids])


def test_packed_layers_match_their_float_forms():
    torch.manual_seed(0)
    linear = Linear(50, 37, True, torch.float32)
    embedding = Embedding(100, 50, torch.float32)
    for param in (linear.weight, linear.bias, embedding.weight):
        param.data.normal_()
    x = torch.randn(6, 50)
    ids = torch.tensor([3, 99, 0, 64])
    reference = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    table = embedding.weight.detach().clone()
    module = torch.nn.ModuleList([linear, embedding])
    pack_dense_weights(module)
    assert linear.weight is None and embedding.weight is None and linear.packed is not None
    assert torch.allclose(linear(x).double(), reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(embedding(ids), table[ids])


def test_packed_logits_are_float32_into_the_callers_buffer():
    torch.manual_seed(1)
    head = VocabParallelEmbedding(70, 24, torch.bfloat16)
    head.weight.data.normal_()
    table = head.weight.detach().clone()
    pack_dense_weights(head)
    hidden = torch.randn(3, 24).bfloat16()
    out = torch.empty(3, 70)
    logits = head.logits(hidden, out)
    assert logits.data_ptr() == out.data_ptr() and logits.dtype == torch.float32
    _check_close(logits, hidden.float(), table.float())


def test_bad_arguments_raise():
    w = torch.randn(40, 16)
    packed = ops.pack_dense_weight(w)
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="does not hold"):
        ops.dense_matmul(x, packed, 70)
    with pytest.raises(ValueError, match="x must be"):
        ops.dense_matmul(torch.randn(2, 15), packed, 40)
    with pytest.raises(TypeError, match="bias must have dtype"):
        ops.dense_matmul(x, packed, 40, torch.randn(40).double())
    with pytest.raises(ValueError, match="bias must be"):
        ops.dense_matmul(x, packed, 40, torch.randn(39))
    with pytest.raises(ValueError, match="out must be"):
        ops.dense_matmul(x, packed, 40, out=torch.empty(2, 39))
    with pytest.raises(ValueError, match="x's dtype .* or float32"):
        ops.dense_matmul(x, packed, 40, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x's dtype .* or float32"):
        ops.dense_matmul(x.bfloat16(), packed, 40, out=torch.empty(2, 40, dtype=torch.float16))
    with pytest.raises(ValueError, match="weight must be"):
        ops.pack_dense_weight(torch.randn(4, 0))
    with pytest.raises(ValueError, match="weight must be"):
        ops.pack_dense_weight(torch.randn(4, 6).int())
