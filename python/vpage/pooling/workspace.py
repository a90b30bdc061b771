"""Activation buffers kept across layers and steps.

A step's activations are tens of MB (8192 tokens x 1536 floats is 50 MB); allocated afresh,
each comes from mmap and is faulted in page by page, which costs several times the
elementwise op that fills it (torch's out-of-place GELU on such a tensor: ~4x its in-place
time on the CPU). The encoder writes into these buffers instead (``out=`` matmuls, in-place
activation, residual and LayerNorm)."""

from __future__ import annotations

import torch


class Workspace:
    """Named 2-D buffers, each grown to the most rows asked for and reused after."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``[rows, cols]`` view (contiguous) of buffer ``name``; its contents are whatever
        was last written. A buffer of another width, dtype or device is replaced."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != cols or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(rows, 1), cols, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:rows]
