"""The fused mixture-of-experts block: expert stacks packed at load time, routing, and the chosen
experts in one kernel (CPU: packed float or GGUF block experts; CUDA: plain stacks)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from vpage import _ops_cpu
from vpage.ops._common import _SUPPORTED_DTYPES, _backend, _check_tensor, _checking
from vpage.ops.matmul import DENSE_PANEL_ROWS, _checked_matmul_rows, _quant_format, quant_row_bytes


def pack_expert_weights(weights: torch.Tensor) -> torch.Tensor:
    """A stack of float expert matrices ``[num_experts, n, k]`` (CPU) packed for
    :func:`fused_moe`: ``[num_experts, ceil(n / 32), k, 32]``, each expert as
    :func:`pack_dense_weight` packs one matrix."""
    _check_tensor("weights", weights, ndim=3, device=torch.device("cpu"), contiguous=False)
    if weights.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"weights must be float32, bfloat16 or float16, got {weights.dtype}")
    num_experts, n, k = weights.shape
    packed = torch.empty(num_experts, -(-n // DENSE_PANEL_ROWS), k, DENSE_PANEL_ROWS, dtype=weights.dtype)
    for e in range(num_experts):  # at load time, once
        _ops_cpu.dense_pack(packed[e], weights[e].contiguous())
    return packed


def _expert_rows(name: str, w: torch.Tensor, qtype: object, n: int, k: int) -> Optional[int]:
    """Checks expert stack ``w`` as n x k matrices: packed float ``[E, ceil(n / 32), k, 32]``
    (qtype None) or uint8 GGUF block rows ``[E, n, quant_row_bytes(qtype, k)]``, each expert's
    matrix contiguous (experts any bytes apart); returns the ggml type id or None."""
    _check_tensor(name, w, device=torch.device("cpu"), contiguous=False)
    if qtype is None:
        shape = (w.shape[0], -(-n // DENSE_PANEL_ROWS), k, DENSE_PANEL_ROWS)
        if w.dtype not in _SUPPORTED_DTYPES or tuple(w.shape) != shape or not w[0].is_contiguous():
            raise ValueError(f"{name} must be float experts packed by pack_expert_weights, {shape} with each "
                             f"expert contiguous, got {w.dtype} {tuple(w.shape)} strides {w.stride()}")
        return None
    row_bytes = quant_row_bytes(qtype, k)
    if w.dtype != torch.uint8 or tuple(w.shape) != (w.shape[0], n, row_bytes) or not w[0].is_contiguous():
        raise ValueError(f"{name} must be uint8 [experts, {n}, {row_bytes}] ({qtype} rows of {k} values) with each "
                         f"expert contiguous, got {w.dtype} {tuple(w.shape)} strides {w.stride()}")
    return _quant_format(qtype)[0]


def _moe_intermediate(w2: torch.Tensor, qtype: object) -> int:
    """The intermediate size of the down stack ``w2`` (the columns of its rows)."""
    if w2.dim() != 3 + (qtype is None):
        raise ValueError(f"w2 has shape {tuple(w2.shape)}, expected packed [E, ceil(hidden / 32), intermediate, 32] "
                         "or block rows [E, hidden, row_bytes]")
    if qtype is None:
        return w2.shape[2]
    _, values, size = _quant_format(qtype)
    return w2.shape[2] // size * values


def _check_routing(m: int, num_experts: int, router_logits: Optional[torch.Tensor], top_k: int,
                   topk_ids: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor]) -> int:
    """Checks router logits or top-k ids/weights for m tokens; returns top_k."""
    if router_logits is not None:
        _check_tensor("router_logits", router_logits, dtype=torch.float32, ndim=2, device=torch.device("cpu"))
        if tuple(router_logits.shape) != (m, num_experts):
            raise ValueError(f"router_logits must be [{m}, {num_experts}], got {tuple(router_logits.shape)}")
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be an int in [1, {num_experts}], got {top_k!r}")
        return top_k
    if topk_ids is None or topk_weights is None:
        raise ValueError("fused_moe needs router_logits and top_k, or topk_ids and topk_weights")
    _check_tensor("topk_ids", topk_ids, dtype=torch.int32, ndim=2, device=torch.device("cpu"))
    _check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2, device=torch.device("cpu"))
    if topk_ids.shape[0] != m or topk_weights.shape != topk_ids.shape or not 1 <= topk_ids.shape[1] <= num_experts:
        raise ValueError(f"topk_ids and topk_weights must both be [{m}, top_k <= {num_experts}], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    return topk_ids.shape[1]


def fused_moe(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
              router_logits: Optional[torch.Tensor] = None, top_k: int = 0, renormalize: bool = False, *,
              topk_ids: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
              qtypes: Sequence[object] = (None, None, None), out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A mixture-of-experts block, ``out[t] = sum_j weight[t, j] * w2_e(silu(w1_e(x[t])) * w3_e(x[t]))``
    over the experts ``e`` chosen for token ``t`` (CPU: one C++ kernel, see fused_moe.h).

    x ``[m, hidden]`` float32, bfloat16 or float16 (rows may be strided). Routing: float32
    ``router_logits`` ``[m, experts]`` -> softmax, the ``top_k`` largest, divided by their sum when
    ``renormalize`` (Mixtral; Qwen-MoE's ``norm_topk_prob``); or given ``topk_ids`` (int32) and
    ``topk_weights`` (float32) ``[m, top_k]``. Expert stacks: w1 (gate) and w3 (up) hold
    ``[intermediate, hidden]`` matrices, w2 (down) ``[hidden, intermediate]``, each either float
    packed by :func:`pack_expert_weights` (qtype None) or raw GGUF block rows (uint8 ``[E, n,
    row_bytes]``, qtype a name of ``QUANT_TYPES``; views such as a fused gate/up stack's halves
    work). ``qtypes``: the (w1, w3, w2) formats. Returns out ``[m, hidden]`` in x's dtype.

    On CUDA (vpage's grouped kernel): plain stacks of x's dtype, w1 and w3 ``[E, intermediate,
    hidden]``, w2 ``[E, hidden, intermediate]``, each expert contiguous; no block formats."""
    if x.device.type == "cuda":
        return _fused_moe_cuda(x, w1, w3, w2, router_logits, top_k, renormalize, topk_ids, topk_weights, qtypes,
                               out)
    if not _checking():
        intermediate = _moe_intermediate(w2, qtypes[2])
        type_ids = [None if q is None else _quant_format(q)[0] for q in qtypes]
        if out is None:
            out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype)
        k = top_k if router_logits is not None else topk_ids.shape[1]
        _ops_cpu.fused_moe(out, x, router_logits, topk_ids, topk_weights, k, renormalize, w1, w3, w2, type_ids,
                           intermediate)
        return out
    _check_tensor("x", x, ndim=2, contiguous=False)
    if x.device.type != "cpu":
        raise ValueError(f"fused_moe runs on the CPU, x is on {x.device}")
    if len(qtypes) != 3:
        raise ValueError(f"qtypes must be the formats of (w1, w3, w2), got {qtypes!r}")
    hidden = x.shape[1]
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        _check_tensor(name, w, contiguous=False)
    intermediate = _moe_intermediate(w2, qtypes[2])
    num_experts = w1.shape[0]
    if w3.shape[0] != num_experts or w2.shape[0] != num_experts or intermediate <= 0:
        raise ValueError(f"w1, w3 and w2 must hold the same experts, got {tuple(w1.shape)}, {tuple(w3.shape)}, "
                         f"{tuple(w2.shape)}")
    type_ids = [_expert_rows("w1", w1, qtypes[0], intermediate, hidden),
                _expert_rows("w3", w3, qtypes[1], intermediate, hidden),
                _expert_rows("w2", w2, qtypes[2], hidden, intermediate)]
    k = _check_routing(x.shape[0], num_experts, router_logits, top_k, topk_ids, topk_weights)
    out = _checked_matmul_rows(x, hidden, hidden, out)
    _ops_cpu.fused_moe(out, x, router_logits, topk_ids, topk_weights, k, renormalize, w1, w3, w2, type_ids,
                       intermediate)
    return out


def _fused_moe_cuda(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                    router_logits: Optional[torch.Tensor], top_k: int, renormalize: bool,
                    topk_ids: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], qtypes: Sequence[object],
                    out: Optional[torch.Tensor]) -> torch.Tensor:
    """fused_moe on CUDA tensors: plain expert stacks (see fused_moe)."""
    if any(q is not None for q in qtypes):
        raise ValueError("fused_moe on CUDA takes float expert stacks, not GGUF blocks")
    num_experts, intermediate, hidden = w1.shape
    if _checking():
        _check_tensor("x", x, ndim=2, contiguous=False)
        if x.dtype not in _SUPPORTED_DTYPES or (hidden > 1 and x.stride(1) != 1) or x.shape[1] != hidden:
            raise ValueError(f"x must be a float [m, {hidden}] tensor with contiguous columns, got {x.dtype} "
                             f"{tuple(x.shape)}")
        for name, w, shape in (("w1", w1, (num_experts, intermediate, hidden)),
                               ("w3", w3, (num_experts, intermediate, hidden)),
                               ("w2", w2, (num_experts, hidden, intermediate))):
            _check_tensor(name, w, dtype=x.dtype, ndim=3, device=x.device, contiguous=False)
            if tuple(w.shape) != shape or not w[0].is_contiguous():
                raise ValueError(f"{name} must be {shape} with each expert contiguous, got {tuple(w.shape)} "
                                 f"strides {w.stride()}")
        if router_logits is not None:
            _check_tensor("router_logits", router_logits, dtype=torch.float32, ndim=2, device=x.device)
            if tuple(router_logits.shape) != (x.shape[0], num_experts):
                raise ValueError(f"router_logits must be [{x.shape[0]}, {num_experts}], got "
                                 f"{tuple(router_logits.shape)}")
            if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
                raise ValueError(f"top_k must be an int in [1, {num_experts}], got {top_k!r}")
        else:
            _check_tensor("topk_ids", topk_ids, dtype=torch.int32, ndim=2, device=x.device)
            _check_tensor("topk_weights", topk_weights, dtype=torch.float32, ndim=2, device=x.device)
            if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0] or not (
                    1 <= topk_ids.shape[1] <= num_experts) or bool(((topk_ids < 0) | (topk_ids >= num_experts)).any()):
                raise ValueError(f"topk_ids and topk_weights must be [{x.shape[0]}, top_k] with ids in "
                                 f"[0, {num_experts})")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    k = top_k if router_logits is not None else topk_ids.shape[1]
    _backend(x.device).fused_moe(out, x, router_logits, topk_ids, topk_weights, k, renormalize, w1, w3, w2,
                                 intermediate)
    return out
