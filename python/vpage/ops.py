"""Paged-attention kernels with vLLM-like names and shapes, for CPU and CUDA tensors.

KV cache layout per layer (``x = 16 // element_size``)::

    key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value_cache [num_blocks, num_kv_heads, head_size, block_size]
    slot = block_id * block_size + offset_in_block

Every function checks dtype, device, shape and contiguity (raising ``TypeError`` or
``ValueError``) before any kernel runs, then dispatches on the device: CPU tensors go to
``vpage._ops_cpu``, CUDA tensors to ``vpage._ops_cuda`` (imported on first use).

Inside ``with trusted_arguments():`` the layer ops skip those checks (on this thread): for a
caller that has just validated the same kind of arguments, such as a model whose first layer
of a step ran checked and whose other layers repeat its shapes, dtypes and devices.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import numbers
import threading
from types import ModuleType
from typing import Iterator, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from vpage import _ops_cpu

__all__ = [
    "reshape_and_cache", "paged_attention", "paged_prefill_attention", "copy_blocks",
    "swap_blocks", "rotary_embedding", "key_cache_shape", "value_cache_shape", "set_num_threads",
    "get_num_threads", "set_thread_source", "rms_norm", "fused_add_rms_norm", "rms_norm_heads_",
    "silu_and_mul", "gelu_tanh_and_mul", "sigmoid_gated_add_", "QUANT_TYPES", "quant_row_bytes", "quant_matmul",
    "dequantize_rows", "pack_dense_weight", "dense_matmul", "dense_rows", "pack_expert_weights", "fused_moe",
    "logsumexp_argmax",
    "token_bitmask_words", "apply_token_bitmask_", "trusted_arguments",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_local = threading.local()  # .trusted: inside trusted_arguments()


@contextlib.contextmanager
def trusted_arguments() -> Iterator[None]:
    """Within the block, on this thread, reshape_and_cache, paged_attention,
    paged_prefill_attention, rotary_embedding, rms_norm, fused_add_rms_norm, rms_norm_heads_,
    silu_and_mul, gelu_tanh_and_mul, quant_matmul and dense_matmul skip their argument checks. Only for
    arguments of the kind the caller has just seen pass them (same dtypes, devices, layouts and
    consistent shapes): a wrong argument then reaches the kernel unchecked."""
    previous = getattr(_local, "trusted", False)
    _local.trusted = True
    try:
        yield
    finally:
        _local.trusted = previous


def _checking() -> bool:
    return not getattr(_local, "trusted", False)


def set_num_threads(num_threads: Optional[int]) -> None:
    """Threads of the CPU kernels (None: torch.get_num_threads(), read at each call)."""
    _ops_cpu.set_num_threads(num_threads)


def get_num_threads() -> int:
    """Threads the CPU kernels run on."""
    return _ops_cpu.get_num_threads()


def set_thread_source(source: str) -> str:
    """Where the CPU kernels' threads come from: ``"openmp"`` (the default: torch's OpenMP
    threads, shared with torch's own ops so the two never contend for the cores) or
    ``"own"`` (vpage's thread pool). Returns the OpenMP runtime's file name in use, or ""
    for the own pool (also what ``"openmp"`` gives when no OpenMP runtime is loaded)."""
    return _ops_cpu.set_thread_source(source)


def _pack_size(dtype: torch.dtype) -> int:
    if dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"unsupported KV cache dtype {dtype}; expected float32, float16 or bfloat16")
    return 16 // dtype.itemsize


def key_cache_shape(num_blocks: int, num_kv_heads: int, head_size: int, block_size: int,
                    dtype: torch.dtype) -> Tuple[int, int, int, int, int]:
    """Shape of one layer's key cache: [num_blocks, num_kv_heads, head_size // x, block_size, x]."""
    x = _pack_size(dtype)
    if head_size % x:
        raise ValueError(f"head_size {head_size} must be a multiple of {x} for {dtype}")
    return (num_blocks, num_kv_heads, head_size // x, block_size, x)


def value_cache_shape(num_blocks: int, num_kv_heads: int, head_size: int, block_size: int,
                      dtype: torch.dtype) -> Tuple[int, int, int, int]:
    """Shape of one layer's value cache: [num_blocks, num_kv_heads, head_size, block_size]."""
    _pack_size(dtype)
    return (num_blocks, num_kv_heads, head_size, block_size)


def _backend(device: torch.device) -> ModuleType:
    if device.type == "cpu":
        return _ops_cpu
    if device.type == "cuda":
        try:
            return importlib.import_module("vpage._ops_cuda")
        except ImportError as exc:
            raise RuntimeError("CUDA tensors need vpage built with CUDA (vpage._ops_cuda)") from exc
    raise ValueError(f"unsupported device {device}; vpage.ops runs on cpu and cuda")


def _check_tensor(name: str, t: object, dtype: Optional[torch.dtype] = None,
                  ndim: Optional[int] = None, device: Optional[torch.device] = None,
                  contiguous: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return t


def _check_rows(name: str, t: torch.Tensor) -> None:
    """A [tokens, heads, head_size] tensor whose inner two dims are contiguous."""
    if t.dim() != 3:
        raise ValueError(f"{name} must have shape [tokens, heads, head_size], got {tuple(t.shape)}")
    if t.shape[0] > 0 and (t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.stride(0) < t.shape[1] * t.shape[2]):
        raise ValueError(f"{name} must have contiguous [heads, head_size] rows (strides {t.stride()})")


def _check_caches(key_cache: object, value_cache: object) -> Tuple[int, int, int, int]:
    """Returns (num_blocks, num_kv_heads, head_size, block_size) of a key/value cache pair."""
    _check_tensor("key_cache", key_cache, ndim=5)
    _check_tensor("value_cache", value_cache, ndim=4, dtype=key_cache.dtype, device=key_cache.device)
    num_blocks, num_kv_heads, head_size, block_size = value_cache.shape
    expected = key_cache_shape(num_blocks, num_kv_heads, head_size, block_size, key_cache.dtype)
    if tuple(key_cache.shape) != expected:
        raise ValueError(f"key_cache shape {tuple(key_cache.shape)} does not match value_cache shape "
                         f"{tuple(value_cache.shape)}; expected {expected}")
    return num_blocks, num_kv_heads, head_size, block_size


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes key/value [num_tokens, num_kv_heads, head_size] into their cache slots.

    slot_mapping: int64 [num_tokens], slot < 0 skips the token. key/value have the caches'
    device and dtype (on CPU also float32 with a 16-bit cache: rounded to the cache's dtype
    when written); their rows may be strided (e.g. slices of a fused QKV output).
    """
    device = key_cache.device
    if _checking():
        _check_cache_writes(key, value, key_cache, value_cache, slot_mapping)
    _backend(device).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def _check_cache_writes(key, value, key_cache, value_cache, slot_mapping) -> None:
    _, num_kv_heads, head_size, _ = _check_caches(key_cache, value_cache)
    device = key_cache.device
    for name, t in (("key", key), ("value", value)):
        _check_tensor(name, t, device=device, contiguous=False)
        _check_activation_dtype(name, t, key_cache)
        _check_rows(name, t)
        if tuple(t.shape[1:]) != (num_kv_heads, head_size):
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match the cache "
                             f"[num_tokens, {num_kv_heads}, {head_size}]")
    if key.dtype != value.dtype:
        raise TypeError(f"key and value must have one dtype, got {key.dtype} and {value.dtype}")
    _check_tensor("slot_mapping", slot_mapping, dtype=torch.int64, ndim=1, device=device)
    if not key.shape[0] == value.shape[0] == slot_mapping.shape[0]:
        raise ValueError(f"key, value and slot_mapping disagree on num_tokens: {key.shape[0]}, "
                         f"{value.shape[0]}, {slot_mapping.shape[0]}")


def kv_dtypes_supported(activation: torch.dtype, cache: torch.dtype, device: torch.device) -> bool:
    """Whether activations (key/value written, query and out) of dtype ``activation`` may meet a
    KV cache of dtype ``cache``: the same dtype, or on CPU float32 with a 16-bit cache."""
    return activation == cache or (torch.device(device).type == "cpu" and activation == torch.float32
                                   and cache in _SUPPORTED_DTYPES)


def _check_activation_dtype(name: str, t: torch.Tensor, key_cache: torch.Tensor) -> None:
    if not kv_dtypes_supported(t.dtype, key_cache.dtype, key_cache.device):
        allowed = "the cache's dtype" + (" or float32" if key_cache.device.type == "cpu" else "")
        raise TypeError(f"{name} must have {allowed} ({key_cache.dtype}), got {t.dtype}")


_INT32_MAX = 2**31 - 1


def _check_window_args(sliding_window: object, logits_soft_cap: object) -> None:
    """sliding_window: None or a positive int; logits_soft_cap: None or a positive finite float."""
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
            raise TypeError(f"sliding_window must be a positive int or None (no window), got {sliding_window!r}")
        if sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int or None (no window), got {sliding_window!r}")
    if logits_soft_cap is not None:
        if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, numbers.Real):
            raise TypeError(f"logits_soft_cap must be a positive finite float or None (no cap), "
                            f"got {logits_soft_cap!r}")
        if not math.isfinite(logits_soft_cap) or logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be a positive finite float or None (no cap), "
                             f"got {logits_soft_cap!r}")


def _attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
               scale, max_context_len, out, sliding_window, logits_soft_cap) -> torch.Tensor:
    device = key_cache.device
    if _checking():
        _check_window_args(sliding_window, logits_soft_cap)
    # The kernels' encoding: 0 = off (a window of at least the context is no window).
    window = 0 if sliding_window is None else min(int(sliding_window), _INT32_MAX)
    cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
    if not _checking():
        if max_context_len is None:
            max_context_len = int(context_lens.max()) if context_lens.shape[0] else 0
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=device)
        _backend(device).paged_attention(out, query, key_cache, value_cache, block_tables,
                                         context_lens, query_start_loc, float(scale), max_context_len,
                                         window, cap)
        return out
    _, num_kv_heads, head_size, _ = _check_caches(key_cache, value_cache)
    _check_tensor("query", query, device=device, contiguous=False)
    _check_activation_dtype("query", query, key_cache)
    _check_rows("query", query)
    num_heads = query.shape[1]
    if query.shape[2] != head_size:
        raise ValueError(f"query head_size {query.shape[2]} != cache head_size {head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    _check_tensor("block_tables", block_tables, dtype=torch.int32, ndim=2, device=device)
    _check_tensor("context_lens", context_lens, dtype=torch.int32, ndim=1, device=device)
    num_seqs = context_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, context_lens {num_seqs}")
    if query_start_loc is None:
        if query.shape[0] != num_seqs:
            raise ValueError(f"decode query has {query.shape[0]} tokens for {num_seqs} sequences")
    else:
        _check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1, device=device)
        if query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
                             f"got {query_start_loc.shape[0]}")
    if not isinstance(scale, (float, int)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float, got {scale!r}")
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if num_seqs else 0
    elif not isinstance(max_context_len, int) or max_context_len < 0:
        raise ValueError(f"max_context_len must be a non-negative int, got {max_context_len!r}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=device)
    else:
        _check_tensor("out", out, dtype=query.dtype, device=device)
        if out.shape != query.shape:
            raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    _backend(device).paged_attention(out, query, key_cache, value_cache, block_tables,
                                     context_lens, query_start_loc, float(scale), max_context_len,
                                     window, cap)
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    max_context_len: Optional[int] = None,
                    out: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                    logits_soft_cap: Optional[float] = None) -> torch.Tensor:
    """Decode attention: one query token per sequence over its cached K/V.

    query [num_seqs, num_heads, head_size] (cache dtype, or float32 on CPU; num_heads a multiple of
    num_kv_heads), block_tables int32 [num_seqs, max_blocks], context_lens int32 [num_seqs]
    (tokens in the cache, including the query's). Returns out [num_seqs, num_heads, head_size].

    sliding_window (positive int, None = off): a query at position p attends keys at positions
    j with p - sliding_window < j <= p; blocks wholly before the window are not read, and their
    block-table entries may hold anything (e.g. -1 for freed blocks). logits_soft_cap (positive
    float, None = off): each score s = scale * (q . k) becomes cap * tanh(s / cap) before the
    softmax.
    """
    return _attention(query, key_cache, value_cache, block_tables, context_lens, None, scale,
                      max_context_len, out, sliding_window, logits_soft_cap)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, max_context_len: Optional[int] = None,
                            out: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                            logits_soft_cap: Optional[float] = None) -> torch.Tensor:
    """Causal (chunked) prefill attention over cached K/V.

    query [num_tokens, num_heads, head_size]; the tokens of sequence s are rows
    [query_start_loc[s], query_start_loc[s+1]) (int32 [num_seqs + 1]) and are the last
    tokens of its context_lens[s] tokens, whose K/V are already in the cache.
    sliding_window and logits_soft_cap as in :func:`paged_attention` (blocks wholly before the
    window of a sequence's first query are not read).
    """
    return _attention(query, key_cache, value_cache, block_tables, context_lens,
                      query_start_loc, scale, max_context_len, out, sliding_window, logits_soft_cap)


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copies blocks src -> dst (int64 block_mapping [num_pairs, 2]) in every layer's caches.

    All caches share one shape, dtype and device; block_mapping is on that device or the CPU.
    """
    if len(key_caches) != len(value_caches):
        raise ValueError(f"{len(key_caches)} key caches but {len(value_caches)} value caches")
    _check_tensor("block_mapping", block_mapping, dtype=torch.int64, ndim=2)
    if block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must have shape [num_pairs, 2], got {tuple(block_mapping.shape)}")
    if not key_caches:
        return
    _check_caches(key_caches[0], value_caches[0])
    device = key_caches[0].device
    for i, (k, v) in enumerate(zip(key_caches, value_caches)):
        _check_caches(k, v)
        if k.shape != key_caches[0].shape or k.dtype != key_caches[0].dtype or k.device != device:
            raise ValueError(f"layer {i} caches differ in shape, dtype or device from layer 0")
    if block_mapping.device not in (device, torch.device("cpu")):
        raise ValueError(f"block_mapping is on {block_mapping.device}, expected {device} or cpu")
    if device.type == "cpu" and block_mapping.device.type != "cpu":
        raise ValueError("block_mapping must be on the CPU for CPU caches")
    _backend(device).copy_blocks(list(key_caches), list(value_caches), block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies whole blocks of one cache tensor to another (int64 CPU block_mapping [num_pairs, 2]).

    src and dst have the same dtype and per-block shape (shape[1:]); e.g. GPU <-> pinned CPU.
    """
    _check_tensor("src", src)
    _check_tensor("dst", dst, dtype=src.dtype)
    if src.dim() < 2 or tuple(src.shape[1:]) != tuple(dst.shape[1:]):
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must share the per-block shape")
    _check_tensor("block_mapping", block_mapping, dtype=torch.int64, ndim=2, device=torch.device("cpu"))
    if block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must have shape [num_pairs, 2], got {tuple(block_mapping.shape)}")
    device = src.device if src.device.type != "cpu" else dst.device
    _backend(device).swap_blocks(src, dst, block_mapping)


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
    else:
        out.copy_(_torch_rms_norm(input, weight, epsilon))


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """In place: ``residual += input``, then ``input = rms_norm(residual) * weight`` (as
    :func:`rms_norm`); both ``[num_tokens, hidden_size]``, contiguous."""
    if _checking():
        _check_norm(input, "residual", residual, weight, epsilon)
    if input.device.type == "cpu":
        _ops_cpu.rms_norm(input, input, residual, weight, epsilon)
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


def logsumexp_argmax(logits: torch.Tensor, want_log_norm: Optional[torch.Tensor] = None,
                     bitmask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per row of float32 ``logits`` ``[n, vocab]`` (rows may be strided, columns contiguous):
    ``(torch.logsumexp(logits, -1), logits.argmax(-1))`` as float32 ``[n]`` and int64 ``[n]``.

    The argmax is torch's exactly (the first of equal maxima; a NaN counts as the maximum);
    the log-normaliser is within a few 1e-7 relative of a float64 logsumexp. ``want_log_norm``
    (bool ``[n]``, default all): rows it leaves out get only the argmax (their log-normaliser
    is NaN), which on the CPU costs one pass over the row instead of two. A fused kernel on
    the CPU (one pass for the maximum, one for the sum of exponentials); torch elsewhere.
    ``bitmask`` (int32 ``[n, token_bitmask_words(vocab)]``, see apply_token_bitmask_): the
    argmax is over the allowed tokens only, i.e. torch's argmax of the row with its disallowed
    entries set to -inf (a row allowing none gives token 0); the log-normaliser stays that of
    the whole row. On the CPU from the same passes (rows allowing every token cost what they
    cost without a bitmask); elsewhere the argmax of a masked copy."""
    _check_tensor("logits", logits, dtype=torch.float32, ndim=2, contiguous=False)
    n, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits must have at least one column")
    if want_log_norm is not None:
        _check_tensor("want_log_norm", want_log_norm, dtype=torch.bool, ndim=1)
        if want_log_norm.shape[0] != n or want_log_norm.device.type != "cpu":
            raise ValueError(f"want_log_norm must be a CPU bool tensor of {n} rows, got "
                             f"{tuple(want_log_norm.shape)} on {want_log_norm.device}")
    if bitmask is not None:
        _check_bitmask(logits, bitmask)
    if logits.device.type != "cpu" or n == 0 or not _rows_apart(logits):
        log_norm = torch.logsumexp(logits, dim=-1)
        if want_log_norm is not None:
            log_norm.masked_fill_(~want_log_norm.to(log_norm.device), float("nan"))
        if bitmask is None:
            return log_norm, logits.argmax(dim=-1)
        masked = logits.clone(memory_format=torch.contiguous_format)
        apply_token_bitmask_(masked, bitmask)
        return log_norm, masked.argmax(dim=-1)
    log_norm = torch.empty(n, dtype=torch.float32)
    argmax = torch.empty(n, dtype=torch.int64)
    _ops_cpu.logsumexp_argmax(logits, log_norm, argmax,
                              None if want_log_norm is None else want_log_norm.contiguous(), bitmask)
    return log_norm, argmax


def _rows_apart(x: torch.Tensor) -> bool:
    """Contiguous columns and rows at least a row apart (the layout of the row kernels)."""
    n, width = x.shape
    return (width <= 1 or x.stride(1) == 1) and (n <= 1 or x.stride(0) >= width)


def token_bitmask_words(vocab: int) -> int:
    """int32 words of one row of a token bitmask over ``vocab`` tokens (xgrammar's layout:
    bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed)."""
    return (vocab + 31) // 32


def _check_bitmask(logits: torch.Tensor, bitmask: object) -> None:
    _check_tensor("bitmask", bitmask, dtype=torch.int32, ndim=2)
    n, vocab = logits.shape
    words = bitmask.shape[1]
    if bitmask.shape[0] != n or words < token_bitmask_words(vocab) or bitmask.device != logits.device:
        raise ValueError(f"bitmask must be int32 [{n}, >= {token_bitmask_words(vocab)}] on {logits.device}, got "
                         f"{tuple(bitmask.shape)} on {bitmask.device}")


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: ``-inf`` in float32 ``logits`` ``[n, vocab]`` (rows may be strided, columns
    contiguous) wherever the contiguous int32 ``bitmask`` ``[n, >= token_bitmask_words(vocab)]``
    has a 0 bit (bits past ``vocab`` are ignored; rows of all ones are unchanged). A kernel on
    the CPU (vectorised, threads over rows and over the vocabulary) and on CUDA."""
    _check_tensor("logits", logits, dtype=torch.float32, ndim=2, contiguous=False)
    _check_bitmask(logits, bitmask)
    if not _rows_apart(logits):
        raise ValueError(f"logits must have contiguous columns and rows at least a row apart (strides "
                         f"{logits.stride()})")
    if logits.numel() == 0:
        return
    _backend(logits.device).apply_token_bitmask(logits, bitmask)


# GGUF block formats the CPU keeps quantized: name -> (ggml type id, values per block, bytes per block).
QUANT_TYPES = {
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
}
_QUANT_BY_ID = {tid: (name, values, size) for name, (tid, values, size) in QUANT_TYPES.items()}


def _quant_format(qtype: object) -> Tuple[int, int, int]:
    """(ggml type id, values per block, bytes per block) of a type name or id (or a gguf enum)."""
    if isinstance(qtype, str) and qtype in QUANT_TYPES:
        return QUANT_TYPES[qtype]
    key = getattr(qtype, "name", qtype)
    if isinstance(key, str) and key in QUANT_TYPES:
        return QUANT_TYPES[key]
    if isinstance(qtype, int) and qtype in _QUANT_BY_ID:
        return (int(qtype),) + _QUANT_BY_ID[int(qtype)][1:]
    raise ValueError(f"unsupported quantization type {qtype!r}; supported: {sorted(QUANT_TYPES)}")


def quant_row_bytes(qtype: object, k: int) -> int:
    """Bytes of one weight row of ``k`` values in block format ``qtype`` (a name such as
    ``"Q4_K"`` or its ggml type id); ValueError unless ``k`` is a positive multiple of the
    block size (32, or 256 for the K types)."""
    _, values, size = _quant_format(qtype)
    if not isinstance(k, int) or k <= 0 or k % values:
        raise ValueError(f"k = {k!r} must be a positive multiple of {values} for {qtype}")
    return k // values * size


def _check_qweight(qweight: object, qtype: object, n: int, k: int) -> Tuple[int, int]:
    """qweight: contiguous CPU uint8 holding n rows of k values; returns (type id, row bytes)."""
    type_id = _quant_format(qtype)[0]
    row_bytes = quant_row_bytes(qtype, k)
    _check_tensor("qweight", qweight, dtype=torch.uint8, device=torch.device("cpu"))
    if not isinstance(n, int) or n < 0 or qweight.numel() != n * row_bytes:
        raise ValueError(f"qweight has {qweight.numel()} bytes; {n!r} rows of {k} values in {qtype} need "
                         f"{n} x {row_bytes}")
    return type_id, row_bytes


def _checked_matmul_rows(x: torch.Tensor, k: int, n: int, out: Optional[torch.Tensor]) -> torch.Tensor:
    """Checks a CPU matmul's 2-D x as ``[m, k]`` (float, contiguous columns, rows at least k
    apart) and ``out`` as ``[m, n]`` of x's dtype and device (None: a new one); returns out."""
    if x.dtype not in _SUPPORTED_DTYPES or x.shape[1] != k or (x.shape[0] > 1 and x.stride(0) < k) or (
            k > 1 and x.stride(1) != 1):
        raise ValueError(f"x must be a float [m, {k}] tensor with contiguous columns, got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")
    m = x.shape[0]
    if out is None:
        return torch.empty(m, n, dtype=x.dtype)
    _check_tensor("out", out, dtype=x.dtype, ndim=2, device=x.device, contiguous=False)
    if tuple(out.shape) != (m, n) or (n > 1 and out.stride(1) != 1) or (m > 1 and out.stride(0) < n):
        raise ValueError(f"out must be [{m}, {n}] with contiguous columns, got {tuple(out.shape)} "
                         f"strides {out.stride()}")
    return out


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: object, n: int, k: int,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out = x @ W.T`` with ``W`` ``[n, k]`` kept in a GGUF block format (CPU only).

    x ``[m, k]`` float32, bfloat16 or float16 (rows may be strided, columns contiguous);
    qweight uint8, the n rows' raw GGUF blocks (``[n, quant_row_bytes(qtype, k)]`` or flat);
    qtype a name of ``QUANT_TYPES`` or its ggml id. Returns out ``[m, n]`` in x's dtype
    (float32 accumulation). The weights are dequantized inside the kernel, never copied.
    With Q4_0, Q4_1, Q8_0 or Q4_K, x is rounded to 8 bits per 32 values and multiplied in
    integers, as llama.cpp does (the decode path up to ``_core.QUANT_INTEGER_PATH_ROWS`` rows,
    the integer GEMM beyond)."""
    if not _checking():
        if out is None:
            out = torch.empty(x.shape[0], n, dtype=x.dtype)
        _ops_cpu.quant_matmul(out, x, qweight, _quant_format(qtype)[0], n, k)
        return out
    type_id, _ = _check_qweight(qweight, qtype, n, k)
    _check_tensor("x", x, ndim=2, contiguous=False)
    if x.device.type != "cpu":
        raise ValueError(f"quant_matmul runs on the CPU, x is on {x.device} (on CUDA, GGUF weights are "
                         "dequantized at load)")
    out = _checked_matmul_rows(x, k, n, out)
    _ops_cpu.quant_matmul(out, x, qweight, type_id, n, k)
    return out


DENSE_PANEL_ROWS = 32  # weight rows per packed panel (_core.DENSE_PANEL_ROWS)


def pack_dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float weight ``[n, k]`` (float32, bfloat16 or float16, CPU, contiguous columns)
    packed for :func:`dense_matmul`: ``[ceil(n / 32), k, 32]`` of its dtype, panel p holding
    rows ``[32 p, 32 p + 32)`` column by column (zeros past row n). Packed once at load time,
    so no matmul repacks it."""
    _check_tensor("weight", weight, ndim=2, device=torch.device("cpu"), contiguous=False)
    n, k = weight.shape
    if weight.dtype not in _SUPPORTED_DTYPES or k == 0 or (k > 1 and weight.stride(1) != 1) or (
            n > 1 and weight.stride(0) < k):
        raise ValueError(f"weight must be a float [n, k > 0] tensor with contiguous columns, got {weight.dtype} "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    packed = torch.empty(-(-n // DENSE_PANEL_ROWS), k, DENSE_PANEL_ROWS, dtype=weight.dtype)
    if n:
        _ops_cpu.dense_pack(packed, weight)
    return packed


def dense_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64 ``[r]``) of the weight that ``packed`` holds, ``[r, k]`` (embedding
    lookups in a table packed for its tied output projection)."""
    return packed[rows // DENSE_PANEL_ROWS, :, rows % DENSE_PANEL_ROWS]


def dense_matmul(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out = x @ W.T (+ bias)`` with ``W`` ``[n, k]`` packed by :func:`pack_dense_weight` (CPU only).

    x ``[m, k]`` float32, bfloat16 or float16 (rows may be strided, columns contiguous); bias
    float32 ``[n]`` or None. Returns out ``[m, n]`` in x's dtype. float32 accumulation, each
    output summed in k order (a row's result does not depend on its batch); 16-bit weights are
    widened in registers, so no 16-bit arithmetic is needed."""
    if not _checking():
        if out is None:
            out = torch.empty(x.shape[0], n, dtype=x.dtype)
        _ops_cpu.dense_matmul(out, x, packed, bias, n)
        return out
    _check_tensor("packed", packed, ndim=3, device=torch.device("cpu"))
    if packed.dtype not in _SUPPORTED_DTYPES or packed.shape[2] != DENSE_PANEL_ROWS or not isinstance(n, int) or not (
            0 <= n <= packed.shape[0] * DENSE_PANEL_ROWS and packed.shape[0] == -(-n // DENSE_PANEL_ROWS)):
        raise ValueError(f"packed {packed.dtype} {tuple(packed.shape)} does not hold {n!r} rows packed by "
                         "pack_dense_weight")
    k = packed.shape[1]
    _check_tensor("x", x, ndim=2, contiguous=False)
    if x.device.type != "cpu":
        raise ValueError(f"dense_matmul runs on the CPU, x is on {x.device}")
    if bias is not None:
        _check_tensor("bias", bias, dtype=torch.float32, ndim=1, device=torch.device("cpu"))
        if bias.shape[0] != n:
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    out = _checked_matmul_rows(x, k, n, out)
    _ops_cpu.dense_matmul(out, x, packed, bias, n)
    return out


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


def dequantize_rows(qweight: torch.Tensor, qtype: object, k: int) -> torch.Tensor:
    """float32 ``[rows, k]`` from ``rows`` weight rows of ``k`` values in block format ``qtype``
    (qweight: contiguous CPU uint8 ``[rows, quant_row_bytes(qtype, k)]``), e.g. the rows of an
    embedding table picked by token id."""
    row_bytes = quant_row_bytes(qtype, k)
    _check_tensor("qweight", qweight, dtype=torch.uint8, device=torch.device("cpu"))
    if qweight.numel() % row_bytes:
        raise ValueError(f"qweight has {qweight.numel()} bytes, not a whole number of {row_bytes}-byte rows")
    rows = qweight.numel() // row_bytes
    out = torch.empty(rows, k, dtype=torch.float32)
    _ops_cpu.dequantize_rows(out, qweight, _quant_format(qtype)[0], rows, k)
    return out
