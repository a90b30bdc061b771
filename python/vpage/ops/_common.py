"""What the op modules share: the float dtypes they take, the switch of the argument checks
(:func:`trusted_arguments`, per thread), dispatch to a device's backend and the tensor check."""

from __future__ import annotations

import contextlib
import importlib
import threading
from types import ModuleType
from typing import Iterator, Optional

import torch

from vpage import _ops_cpu


_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_local = threading.local()  # .trusted: inside trusted_arguments()


@contextlib.contextmanager
def trusted_arguments() -> Iterator[None]:
    """Within the block, on this thread, reshape_and_cache, paged_attention,
    paged_prefill_attention, rotary_embedding, rms_norm, fused_add_rms_norm, rms_norm_heads_,
    silu_and_mul, gelu_tanh_and_mul, quant_matmul, dense_matmul and lora_add skip their argument checks. Only for
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
