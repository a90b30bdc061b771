"""The paged KV cache (layout in :mod:`vpage.ops`): its shapes, the activation dtypes it meets,
writing key/value rows into its slots, and copying whole blocks within a device or between
two caches."""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from vpage.ops._common import _SUPPORTED_DTYPES, _backend, _check_tensor, _checking


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
