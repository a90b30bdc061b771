"""Parameters and their weight loaders.

A parameter that needs more than a plain copy carries ``weight_loader(param, loaded,
shard_id)``: ``loaded`` is one checkpoint tensor (float, or a :class:`QuantizedTensor`),
``shard_id`` names the part of a fused parameter it fills (None: the whole parameter).
Loaders raise ValueError on a shape or type mismatch, worded to follow the tensor's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional

import numpy as np
import torch
from torch import nn

ShardId = Optional[Hashable]  # "q", "k", "v"; 0, 1 (gate, up); None: the whole parameter
WeightLoader = Callable[[nn.Parameter, Any, ShardId], None]


@dataclass
class QuantizedTensor:
    """A checkpoint tensor kept in its GGUF block format: ``data`` uint8 ``[rows, row bytes]``
    holding ``rows`` rows of ``cols`` values of ggml type ``type_id``."""

    data: torch.Tensor
    type_id: int
    cols: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def to_float(self) -> torch.Tensor:
        """float32 ``[rows, cols]``, dequantized by the gguf package (row by row, so rows
        reordered before or after give the same values)."""
        import gguf
        from gguf.quants import dequantize

        try:
            w = dequantize(self.data.numpy(), gguf.GGMLQuantizationType(self.type_id))
        except Exception as e:  # the gguf package raises assorted errors on bad blocks
            raise ValueError(f"cannot be dequantized (ggml type {self.type_id}: {e})") from e
        return torch.from_numpy(np.ascontiguousarray(w))


def empty_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """A frozen parameter of ``shape`` on the current default device, not initialised."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def set_weight_loader(param: nn.Parameter | None, weight_loader: WeightLoader,
                      shard_ids: tuple[ShardId, ...] = (None,)) -> None:
    """``param`` (if any) loads through ``weight_loader``, from one checkpoint tensor per
    shard of ``shard_ids`` (or from one tensor holding them all: shard None)."""
    if param is not None:
        param.weight_loader = weight_loader
        param.shard_ids = shard_ids


def float_tensor(loaded: Any) -> torch.Tensor:
    """A checkpoint tensor as a float tensor (QuantizedTensors dequantized)."""
    return loaded.to_float() if isinstance(loaded, QuantizedTensor) else loaded


def copy_checked(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``dest.copy_(src)`` after checking that the shapes match."""
    if dest.shape != src.shape:
        raise ValueError(f"has shape {tuple(src.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded: Any, shard_id: ShardId = None) -> None:
    """The whole checkpoint tensor into a float parameter (norm weights, unsharded tables)."""
    if shard_id is not None:
        raise ValueError(f"is part {shard_id!r} of a parameter that has no parts")
    copy_checked(param.data, float_tensor(loaded))


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    return getattr(param, "weight_loader", default_weight_loader)


def shard_ids_of(param: nn.Parameter) -> tuple[ShardId, ...]:
    """The parts a checkpoint fills ``param`` from, one tensor each ((None,): one tensor)."""
    return getattr(param, "shard_ids", (None,))
