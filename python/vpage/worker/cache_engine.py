"""The paged KV cache of every layer on the device, the CPU swap pool, and block moves."""

from __future__ import annotations

import logging

import numpy as np
import psutil
import torch

from vpage import ops
from vpage.model_executor.config import ModelConfig

logger = logging.getLogger("vpage")

_GIB = 1 << 30
_DEFAULT_CPU_KV_GIB = 4.0


def bytes_per_block(config: ModelConfig, block_size: int) -> int:
    """Bytes of one block of K and V over all layers."""
    return config.cache_block_bytes(block_size)


def resolve_kv_cache_dtype(name: str, activation: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache dtype that ``name`` ("auto": the activations' dtype, or a dtype name) stands
    for; ValueError when the kernels cannot pair it with ``activation`` on ``device``."""
    if name == "auto":
        return activation
    dtype = getattr(torch, name)
    if not ops.kv_dtypes_supported(activation, dtype, device):
        raise ValueError(
            f"kv_cache_dtype {name} cannot hold the KV cache of {activation} activations on {device.type}: the "
            "cache has the activations' dtype, or on CPU float16 or bfloat16 with float32 activations")
    return dtype


def default_cpu_kv_gib() -> float:
    """A quarter of the available memory, at most 4 GiB."""
    return min(_DEFAULT_CPU_KV_GIB, psutil.virtual_memory().available / _GIB / 4)


class CacheEngine:
    """Owns ``num_gpu_blocks`` blocks per layer on the model's device (the "GPU" pool of the
    block manager, which is host memory on a CPU device), plus ``scratch_blocks`` more that no
    sequence owns (zeroed; padding rows of CUDA graphs read them), and ``num_cpu_blocks`` swap
    blocks in (pinned, on CUDA) host memory. Layouts are those of ``vpage.ops``.

    On CUDA, swaps run on a dedicated stream and record one event per layer after that
    layer's swap-out and swap-in; ``take_layer_events`` hands them to the next forward, whose
    layer i waits on event i. On CPU swaps are synchronous and there are no streams or events.
    """

    def __init__(self, config: ModelConfig, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 device: torch.device, scratch_blocks: int = 0):
        self.config = config
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        self.gpu_cache = self._allocate(num_gpu_blocks + scratch_blocks, device, pin=False)
        self.cpu_cache = self._allocate(num_cpu_blocks, torch.device("cpu"), pin=device.type == "cuda")
        for key, value in self.gpu_cache:
            key[num_gpu_blocks:].zero_()
            value[num_gpu_blocks:].zero_()
        self._stream = None
        self._layer_events: list = []
        self._pending = False  # swaps were queued that no forward has waited for yet
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
            self._layer_events = [torch.cuda.Event() for _ in range(config.num_layers)]

    @property
    def scratch_block(self) -> int:
        """Id of the first block past the block manager's pool."""
        return self.num_gpu_blocks

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        dtype = c.cache_dtype
        key_shape = ops.key_cache_shape(num_blocks, c.num_kv_heads, c.head_size, self.block_size, dtype)
        value_shape = ops.value_cache_shape(num_blocks, c.num_kv_heads, c.head_size, self.block_size, dtype)
        return [
            (torch.empty(key_shape, dtype=dtype, device=device, pin_memory=pin),
             torch.empty(value_shape, dtype=dtype, device=device, pin_memory=pin))
            for _ in range(c.num_layers)
        ]

    def swap(self, swap_out: np.ndarray, swap_in: np.ndarray) -> None:
        """Swap-out ((device block, swap block) pairs ``[n, 2]`` int64) then swap-in ((swap
        block, device block) pairs), layer by layer. Swap-out first: a device block it frees
        can be a swap-in destination of the same step."""
        if len(swap_out) == 0 and len(swap_in) == 0:
            return
        out_pairs, in_pairs = torch.from_numpy(swap_out), torch.from_numpy(swap_in)
        if self._stream is None:
            self._swap_layers(out_pairs, in_pairs)
            return
        # Swap-outs read K/V that earlier forwards wrote; swap-ins overwrite blocks they may read.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._swap_layers(out_pairs, in_pairs)
        self._pending = True

    def _swap_layers(self, out_pairs: torch.Tensor, in_pairs: torch.Tensor) -> None:
        for i, ((gpu_k, gpu_v), (cpu_k, cpu_v)) in enumerate(zip(self.gpu_cache, self.cpu_cache)):
            if len(out_pairs):
                ops.swap_blocks(gpu_k, cpu_k, out_pairs)
                ops.swap_blocks(gpu_v, cpu_v, out_pairs)
            if len(in_pairs):
                ops.swap_blocks(cpu_k, gpu_k, in_pairs)
                ops.swap_blocks(cpu_v, gpu_v, in_pairs)
            if self._stream is not None:
                self._layer_events[i].record(self._stream)

    def take_layer_events(self) -> list | None:
        """The per-layer events of swaps no forward has waited for yet (CUDA), else None; the
        caller's forward must wait on event i before layer i touches its cache."""
        if not self._pending:
            return None
        self._pending = False
        return self._layer_events

    def synchronize_swaps(self) -> None:
        """Waits on the host until every queued swap is done (CUDA; no-op otherwise): before the
        host itself reads or writes CPU blocks."""
        if self._stream is not None:
            self._stream.synchronize()

    def wait_for_swaps(self) -> None:
        """Makes the compute stream wait for every queued swap (CUDA; no-op otherwise)."""
        if self._pending:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._pending = False

    def copy(self, mapping: np.ndarray) -> None:
        """(src, dst) device block pairs ``[n, 2]`` int64 (copy-on-write), all layers at once,
        on the compute stream after any queued swap (a destination can be a block a swap-out
        of this step freed; a source can be a block swapped in)."""
        if len(mapping) == 0:
            return
        self.wait_for_swaps()
        ops.copy_blocks([k for k, _ in self.gpu_cache], [v for _, v in self.gpu_cache], torch.from_numpy(mapping))
