"""ops.fused_moe against a float64 per-expert reference: routing from router logits
(renormalised or not) and from given ids (experts without tokens, a token routed to every
expert), packed float32 / bfloat16 experts and GGUF block experts (a fused gate/up stack's
halves as w1 and w3), strided x, bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quant_fixtures import dequantized, quantized_rows
from vpage import _core, ops

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference(x, w1, w3, w2, ids, weights):
    """float64 out [m, hidden]: per expert, its tokens' gated MLP, weighted and summed."""
    x, w1, w3, w2 = (t.double() for t in (x, w1, w3, w2))
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel() == 0:
            continue
        h = torch.nn.functional.silu(x[token] @ w1[e].T) * (x[token] @ w3[e].T)
        out.index_add_(0, token, (h @ w2[e].T) * weights[token, slot, None].double())
    return out


def routing(logits, top_k, renormalize):
    probs = torch.softmax(logits.double(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def random_experts(gen, experts, inter, hidden, dtype=torch.float32):
    def stack(n, k):
        return (torch.randn(experts, n, k, generator=gen) * 0.2).to(dtype)
    return stack(inter, hidden), stack(inter, hidden), stack(hidden, inter)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_float_experts_routed_from_logits(m, renormalize):
    gen = torch.Generator().manual_seed(m)
    hidden, inter, experts, top_k = 72, 40, 6, 2
    w1, w3, w2 = random_experts(gen, experts, inter, hidden)
    x = torch.randn(m, hidden + 5, generator=gen)[:, :hidden]  # strided rows
    logits = torch.randn(m, experts, generator=gen)
    logits[:, 0] -= 30.0  # expert 0 gets no token
    out = ops.fused_moe(x, *(ops.pack_expert_weights(w) for w in (w1, w3, w2)), logits, top_k, renormalize)
    ids, weights = routing(logits, top_k, renormalize)
    assert not (ids == 0).any()
    ref = reference(x, w1, w3, w2, ids, weights)
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


def test_bfloat16_experts_every_token_to_every_expert():
    gen = torch.Generator().manual_seed(3)
    hidden, inter, experts = 64, 48, 4
    w1, w3, w2 = random_experts(gen, experts, inter, hidden, torch.bfloat16)
    x = torch.randn(9, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen) for _ in range(9)]).int()
    weights = torch.rand(9, experts, generator=gen)
    out = ops.fused_moe(x, *(ops.pack_expert_weights(w) for w in (w1, w3, w2)), topk_ids=ids, topk_weights=weights)
    ref = reference(x, w1, w3, w2, ids.long(), weights)
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_block_experts_fused_gate_up(qtype):
    """GGUF rows of a fused gate/up stack: its halves serve as w1 and w3 without a copy. The
    float path (integer GEMM off, more than 16 rows per expert) is float32 on the dequantized
    weights."""
    rng = np.random.default_rng(5)
    hidden, inter, experts, m = 256, 256, 3, 40
    w13 = rng.standard_normal((experts * 2 * inter, hidden)).astype(np.float32) * 0.1
    w2 = rng.standard_normal((experts * hidden, inter)).astype(np.float32) * 0.1
    q13, q2 = quantized_rows(qtype, w13, rng), quantized_rows(qtype, w2, rng)
    d13 = torch.from_numpy(dequantized(qtype, q13)).view(experts, 2 * inter, hidden)
    d2 = torch.from_numpy(dequantized(qtype, q2)).view(experts, hidden, inter)
    t13 = torch.from_numpy(q13).view(experts, 2 * inter, -1)
    t2 = torch.from_numpy(q2).view(experts, hidden, -1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(m, hidden, generator=gen)
    logits = torch.randn(m, experts, generator=gen)
    _core.set_quant_integer_gemm_rows(0)
    try:
        out = ops.fused_moe(x, t13[:, :inter], t13[:, inter:], t2, logits, 2, True, qtypes=(qtype, qtype, qtype))
    finally:
        _core.set_quant_integer_gemm_rows(_core.QUANT_INTEGER_GEMM_MAX_ROWS)
    ids, weights = routing(logits, 2, True)
    ref = reference(x, d13[:, :inter], d13[:, inter:], d2, ids, weights)
    torch.testing.assert_close(out.double(), ref, atol=1e-4 * ref.abs().max().item(), rtol=0)


def test_bad_arguments():
    gen = torch.Generator().manual_seed(0)
    w1, w3, w2 = (ops.pack_expert_weights(w) for w in random_experts(gen, 2, 32, 32))
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match="router_logits must be"):
        ops.fused_moe(x, w1, w3, w2, torch.randn(3, 5), 1)
    with pytest.raises(ValueError, match="top_k must be"):
        ops.fused_moe(x, w1, w3, w2, torch.randn(3, 2), 3)
    with pytest.raises(ValueError, match="not an expert id"):
        ops.fused_moe(x, w1, w3, w2, topk_ids=torch.full((3, 1), 2, dtype=torch.int32), topk_weights=torch.ones(3, 1))
    with pytest.raises(ValueError, match="w1 must be float experts packed"):
        ops.fused_moe(x, w1[:, :, :16], w3, w2, torch.randn(3, 2), 1)
    with pytest.raises(ValueError, match="needs router_logits"):
        ops.fused_moe(x, w1, w3, w2)


def _cuda_ready() -> bool:
    try:
        from vpage import _cuda
    except ImportError:
        return False
    return torch.cuda.is_available() and _cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_ready(), reason="needs an NVIDIA GPU and vpage._cuda")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 7, 300])
def test_cuda_grouped_kernel(dtype, m):
    """vpage's grouped CUDA kernel against the float64 reference (awkward sizes, an expert
    without tokens, ids given for one case) and the CPU kernel."""
    gen = torch.Generator().manual_seed(m)
    hidden, inter, experts, top_k = 136, 72, 6, 2
    w1, w3, w2 = random_experts(gen, experts, inter, hidden, dtype)
    x = torch.randn(m, hidden, generator=gen).to(dtype)
    logits = torch.randn(m, experts, generator=gen)
    logits[:, 3] -= 30.0
    dev = torch.device("cuda")
    out = ops.fused_moe(x.to(dev), w1.to(dev), w3.to(dev), w2.to(dev), logits.to(dev), top_k, True)
    ids, weights = routing(logits, top_k, True)
    ref = reference(x, w1, w3, w2, ids, weights)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype] * ref.abs().max().item()
    torch.testing.assert_close(out.cpu().double(), ref, atol=tol, rtol=0)
    given = ops.fused_moe(x.to(dev), w1.to(dev), w3.to(dev), w2.to(dev), topk_ids=ids.int().to(dev),
                          topk_weights=weights.float().to(dev))
    torch.testing.assert_close(given.cpu().double(), ref, atol=tol, rtol=0)
    cpu = ops.fused_moe(x, *(ops.pack_expert_weights(w) for w in (w1, w3, w2)), logits, top_k, True)
    torch.testing.assert_close(out.cpu().double(), cpu.double(), atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sigmoid_gated_add(dtype):
    """out += sigmoid(gate) * y per row, float32 inside, one rounding to the dtype."""
    gen = torch.Generator().manual_seed(4)
    out, y = (torch.randn(37, 72, generator=gen).to(dtype) for _ in range(2))
    gate = (torch.randn(37, 1, generator=gen) * 4).to(dtype)
    ref = out.double() + torch.sigmoid(gate.double()) * y.double()
    ops.sigmoid_gated_add_(out, y, gate)
    eps = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=eps * ref.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="gate"):
        ops.sigmoid_gated_add_(out, y, gate[:3])
