"""Per-row layer ops: rotary embedding, RMS norms (of rows and of heads) and gated activations
(SiLU, GELU-tanh, a sigmoid-gated add); fused kernels on the CPU and, for rotary, the norms
and SiLU, on CUDA (vpage._cuda); torch's composite ops elsewhere (the kernels' reference)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from vpage import _ops_cpu, _ops_cuda
from vpage.ops._common import _SUPPORTED_DTYPES, _check_tensor, _checking


def _cuda_kernels(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a GPU and vpage was built with its CUDA kernels."""
    return t.device.type == "cuda" and _ops_cuda.HAS_KERNELS


def rotary_embedding(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                     head_size: int, rotary_dim: Optional[int] = None) -> None:
    """Rotates, in place, the first ``num_heads`` heads of every row of ``x`` ``[num_tokens,
    width]`` (e.g. the query then key heads of a fused QKV output; rows may be strided, columns
    contiguous) with the rotate-half convention: ``cos_sin`` float32 ``[max_position,
    rotary_dim]`` holds cos of the rotary_dim/2 frequencies then their sin, ``positions`` int64
    ``[num_tokens]``. ``rotary_dim`` (even, at most head_size; None: head_size) rotates only
    the first rotary_dim elements of each head and leaves the rest (transformers'
    partial_rotary_factor). A fused kernel on the CPU; plain torch operations elsewhere."""
    if rotary_dim is None:
        rotary_dim = head_size
    if _checking():
        _check_rotary(x, positions, cos_sin, num_heads, head_size, rotary_dim)
    if x.device.type == "cpu":
        _ops_cpu.rotary_embedding(x, positions, cos_sin, num_heads, head_size, rotary_dim)
        return
    if _cuda_kernels(x):
        _ops_cuda.rotary_embedding(x, positions, cos_sin, num_heads, head_size, rotary_dim)
        return
    half = rotary_dim // 2
    heads = x[:, : num_heads * head_size].view(x.shape[0], num_heads, head_size)[..., :rotary_dim]
    table = cos_sin[positions][:, None, :]
    cos, sin = table[..., :half], table[..., half:]
    x1, x2 = heads[..., :half].float(), heads[..., half:].float()
    heads.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))


def _check_rotary(x: object, positions: object, cos_sin: object, num_heads: int, head_size: int,
                  rotary_dim: int) -> None:
    _check_tensor("x", x, contiguous=False)
    if x.dtype not in _SUPPORTED_DTYPES or x.dim() != 2 or (x.shape[0] > 0 and x.stride(1) != 1):
        raise ValueError(f"x must be a 2-D float tensor with contiguous columns, got {x.dtype} {tuple(x.shape)}")
    _check_tensor("positions", positions, dtype=torch.int64, ndim=1, device=x.device)
    _check_tensor("cos_sin", cos_sin, dtype=torch.float32, ndim=2, device=x.device)
    if positions.shape[0] != x.shape[0]:
        raise ValueError(f"{positions.shape[0]} positions for {x.shape[0]} rows")
    if not isinstance(rotary_dim, int) or rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        raise ValueError(f"rotary_dim must be an even int in (0, head_size = {head_size}], got {rotary_dim!r}")
    if cos_sin.shape[1] != rotary_dim or num_heads * head_size > x.shape[1]:
        raise ValueError(f"cos_sin {tuple(cos_sin.shape)} (rotary_dim {rotary_dim}), {num_heads} heads of "
                         f"{head_size} do not fit rows of {x.shape[1]}")


def _check_rows_2d(name: str, t: object, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A contiguous 2-D float tensor (of ``like``'s dtype and device when given)."""
    _check_tensor(name, t, ndim=2, dtype=None if like is None else like.dtype,
                  device=None if like is None else like.device)
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    return t


def _check_norm(input: object, other_name: str, other: object, weight: object, eps: float) -> None:
    """input and ``other`` (out or residual): contiguous 2-D, one dtype, one shape; weight
    [hidden_size]; eps >= 0."""
    _check_rows_2d("input", input)
    _check_rows_2d(other_name, other, like=input)
    if other.shape != input.shape:
        raise ValueError(f"{other_name} shape {tuple(other.shape)} differs from input shape {tuple(input.shape)}")
    _check_tensor("weight", weight, ndim=1, dtype=input.dtype, device=input.device)
    if weight.shape[0] != input.shape[1]:
        raise ValueError(f"weight has {weight.shape[0]} elements for rows of {input.shape[1]}")
    if not eps >= 0:
        raise ValueError(f"epsilon must be >= 0, got {eps}")


def _torch_rms_norm(src: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The unfused computation the CPU kernel reproduces (float32 statistics)."""
    normed = F.rms_norm(src.float(), weight.shape, eps=eps)
    return normed.to(src.dtype) * weight


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """``out = input / sqrt(mean(input^2) + epsilon) * weight`` per row of ``input``
    ``[num_tokens, hidden_size]`` (statistics in float32, then cast to the dtype, then times
    ``weight``, like Hugging Face's RMSNorm). ``out`` may be ``input``."""
    if _checking():
        _check_norm(input, "out", out, weight, epsilon)
    if input.device.type == "cpu":
        _ops_cpu.rms_norm(out, input, None, weight, epsilon)
    elif _cuda_kernels(input):
        _ops_cuda.rms_norm(out, input, None, weight, epsilon)
    else:
        out.copy_(_torch_rms_norm(input, weight, epsilon))


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """In place: ``residual += input``, then ``input = rms_norm(residual) * weight`` (as
    :func:`rms_norm`); both ``[num_tokens, hidden_size]``, contiguous."""
    if _checking():
        _check_norm(input, "residual", residual, weight, epsilon)
    if input.device.type == "cpu":
        _ops_cpu.rms_norm(input, input, residual, weight, epsilon)
    elif _cuda_kernels(input):
        _ops_cuda.rms_norm(input, input, residual, weight, epsilon)
    else:
        residual.add_(input)
        input.copy_(_torch_rms_norm(residual, weight, epsilon))


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, epsilon: float, num_heads: int, head_size: int) -> None:
    """In place, each of the first ``num_heads`` heads of every row of ``x`` ``[num_tokens,
    width]`` becomes ``rms_norm(head) * weight`` (``weight`` ``[head_size]``), with the roundings
    of :func:`rms_norm` on the head as a row: the per-head q/k norms (Qwen3, Gemma 3). Rows may be
    strided (e.g. ``qkv[:, q_size:]`` for the key heads of a fused QKV output), columns
    contiguous; the columns past the heads are untouched."""
    if _checking():
        _check_heads(x, weight, epsilon, num_heads, head_size)
    if x.device.type == "cpu":
        _ops_cpu.rms_norm_heads(x, weight, epsilon, num_heads, head_size)
    elif _cuda_kernels(x):
        _ops_cuda.rms_norm_heads(x, weight, epsilon, num_heads, head_size)
    else:
        heads = x[:, : num_heads * head_size].view(x.shape[0], num_heads, head_size)
        heads.copy_(_torch_rms_norm(heads, weight, epsilon))


def _check_heads(x: object, weight: object, eps: float, num_heads: int, head_size: int) -> None:
    _check_tensor("x", x, ndim=2, contiguous=False)
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    _check_tensor("weight", weight, ndim=1, dtype=x.dtype, device=x.device)
    if not isinstance(num_heads, int) or not isinstance(head_size, int) or num_heads < 0 or head_size <= 0:
        raise ValueError(f"num_heads {num_heads!r} and head_size {head_size!r} must be ints, >= 0 and > 0")
    if weight.shape[0] != head_size or num_heads * head_size > x.shape[1]:
        raise ValueError(f"weight of {weight.shape[0]} elements, {num_heads} heads of {head_size} do not fit "
                         f"rows of {x.shape[1]}")
    width = num_heads * head_size
    if x.shape[0] > 0 and width > 0 and (x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < width)):
        raise ValueError(f"x must have contiguous columns and rows at least {width} apart (strides {x.stride()})")
    if not eps >= 0:
        raise ValueError(f"epsilon must be >= 0, got {eps}")


def _check_gated(out: object, input: object) -> None:
    """input ``[num_tokens, 2 d]`` (gate half, then up half) and out ``[num_tokens, d]``, d > 0."""
    _check_rows_2d("input", input)
    _check_rows_2d("out", out, like=input)
    d = out.shape[1]
    if input.shape != (out.shape[0], 2 * d) or d == 0:
        raise ValueError(f"input shape {tuple(input.shape)} must be [num_tokens, 2 * {d}] for out {tuple(out.shape)}")


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """``out = silu(input[:, :d]) * input[:, d:]`` for ``input`` ``[num_tokens, 2 d]`` (the gate
    and up halves of a fused projection) and ``out`` ``[num_tokens, d]``; silu rounded to the
    dtype before the product, like torch's ``F.silu(gate) * up``."""
    d = out.shape[1]
    if _checking():
        _check_gated(out, input)
    if input.device.type == "cpu":
        _ops_cpu.silu_and_mul(out, input)
    elif _cuda_kernels(input):
        _ops_cuda.silu_and_mul(out, input)
    else:
        torch.mul(F.silu(input[:, :d]), input[:, d:], out=out)


def sigmoid_gated_add_(out: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> None:
    """In place ``out += sigmoid(gate) * y`` for contiguous ``out`` and ``y`` ``[num_tokens, d]``
    and ``gate`` ``[num_tokens, 1]`` (or ``[num_tokens]``) of one dtype: a gated branch joining
    a sum (Qwen2-MoE's shared expert). CPU: float32 arithmetic rounded once to the dtype, the
    kernel the C++ layer loop calls too."""
    if _checking():
        _check_tensor("out", out, ndim=2)
        _check_tensor("y", y, dtype=out.dtype, device=out.device)
        _check_tensor("gate", gate, dtype=out.dtype, device=out.device)
        if out.dtype not in _SUPPORTED_DTYPES or y.shape != out.shape or gate.numel() != out.shape[0]:
            raise ValueError(f"out and y must be float [n, d] and gate [n, 1] of one dtype, got {tuple(out.shape)}, "
                             f"{tuple(y.shape)}, {tuple(gate.shape)}")
    if out.device.type == "cpu":
        _ops_cpu.sigmoid_gated_add(out, y, gate)
    else:
        out.add_(y * torch.sigmoid(gate.reshape(-1, 1)))


def gelu_tanh_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """``out = gelu_tanh(input[:, :d]) * input[:, d:]`` (shapes as :func:`silu_and_mul`), like
    torch's ``F.gelu(gate, approximate="tanh") * up`` (gelu rounded to the dtype before the
    product): the gated MLP of Gemma. The CPU kernel evaluates ``0.5 x (1 + tanh(y))`` as
    ``x / (1 + exp(-2 y))``: float32 within ``(2 + |2 y|) 1.6e-7`` relative of the exact
    function (a few 1e-7 for |x| < 2), where torch's ``1 + tanh`` cancels for gates below about
    -2 (absolute error up to ~6e-8 |x|)."""
    d = out.shape[1]
    if _checking():
        _check_gated(out, input)
    if input.device.type == "cpu":
        _ops_cpu.gelu_tanh_and_mul(out, input)
    else:
        torch.mul(F.gelu(input[:, :d], approximate="tanh"), input[:, d:], out=out)
