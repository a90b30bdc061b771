"""Reused host staging buffers for a step's flat inputs (CUDA): numpy -> pinned host ->
device with asynchronous copies, instead of a copy from pageable memory per input per step."""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import torch


class StagingBuffer:
    """One flat input: a host buffer (pinned on CUDA) and a device buffer of the same
    capacity, allocated once and grown (at least doubled) when a step needs more."""

    def __init__(self, dtype: torch.dtype, device: torch.device, capacity: int, pin: bool):
        self.dtype = dtype
        self.device = device
        self.pin = pin
        self.host = torch.empty(0, dtype=dtype)
        self.dev = torch.empty(0, dtype=dtype, device=device)
        self._reserve(max(capacity, 1))

    @property
    def capacity(self) -> int:
        return self.host.shape[0]

    def _reserve(self, n: int) -> None:
        # Dropping the old buffers is safe while a copy from them is in flight: torch's
        # allocators keep (pinned or device) memory until the streams that use it are done.
        self.host = torch.empty(n, dtype=self.dtype, pin_memory=self.pin)
        self.dev = torch.empty(n, dtype=self.dtype, device=self.device)

    def upload(self, array: np.ndarray) -> torch.Tensor:
        """``array`` (C-contiguous, this buffer's dtype) on the device, shaped like it. The
        copy is asynchronous on the current stream; the caller must not upload again before
        it has finished (``StepInputs`` waits on an event)."""
        n = array.size
        if n > self.capacity:
            self._reserve(max(n, 2 * self.capacity))
        host = self.host[:n]
        host.copy_(torch.from_numpy(array.reshape(-1)))
        dev = self.dev[:n]
        dev.copy_(host, non_blocking=True)
        return dev.view(array.shape)


_FIELDS = {
    "input_ids": torch.int64, "positions": torch.int64, "slot_mapping": torch.int64,
    "block_tables": torch.int32, "context_lens": torch.int32, "query_start_loc": torch.int32,
    "sample_token_indices": torch.int64,
}


class StepInputs:
    """The staging buffers of every flat input of a plan, and the event that says the last
    step's host-to-device copies are done (so the host buffers may be overwritten)."""

    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int, max_blocks: int, pin: bool):
        capacity = {"input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
                    "block_tables": max_seqs * max_blocks, "context_lens": max_seqs,
                    "query_start_loc": max_seqs + 1, "sample_token_indices": max_seqs}
        self.device = device
        self.buffers = {name: StagingBuffer(dtype, device, capacity[name], pin) for name, dtype in _FIELDS.items()}
        self._copied: Optional[torch.cuda.Event] = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False

    def upload(self, plan, names: Iterable[str] = _FIELDS) -> dict[str, torch.Tensor]:
        """The flat inputs ``names`` (default: all) of ``plan`` on the device, by name."""
        if self._pending:
            self._copied.synchronize()  # normally long done: sampling already waited for the step
        out = {name: self.buffers[name].upload(getattr(plan, name)) for name in names}
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
            self._pending = True
        return out
