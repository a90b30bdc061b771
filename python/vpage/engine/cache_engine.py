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
    elem = torch.tensor([], dtype=config.dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_size * block_size * elem


def default_cpu_kv_gib() -> float:
    """A quarter of the available memory, at most 4 GiB."""
    return min(_DEFAULT_CPU_KV_GIB, psutil.virtual_memory().available / _GIB / 4)


class CacheEngine:
    """Owns ``num_gpu_blocks`` blocks per layer on the model's device (the "GPU" pool of the
    block manager, which is host memory on a CPU device) and ``num_cpu_blocks`` swap blocks
    in (pinned, on CUDA) host memory. Layouts are those of ``vpage.ops``."""

    def __init__(self, config: ModelConfig, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 device: torch.device):
        self.config = config
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        self.gpu_cache = self._allocate(num_gpu_blocks, device, pin=False)
        self.cpu_cache = self._allocate(num_cpu_blocks, torch.device("cpu"), pin=device.type == "cuda")

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        c = self.config
        key_shape = ops.key_cache_shape(num_blocks, c.num_kv_heads, c.head_size, self.block_size, c.dtype)
        value_shape = ops.value_cache_shape(num_blocks, c.num_kv_heads, c.head_size, self.block_size, c.dtype)
        return [
            (torch.empty(key_shape, dtype=c.dtype, device=device, pin_memory=pin),
             torch.empty(value_shape, dtype=c.dtype, device=device, pin_memory=pin))
            for _ in range(c.num_layers)
        ]

    def swap_out(self, mapping: np.ndarray) -> None:
        """(device block, swap block) pairs ``[n, 2]`` int64: device -> swap pool."""
        self._swap(self.gpu_cache, self.cpu_cache, mapping)

    def swap_in(self, mapping: np.ndarray) -> None:
        """(swap block, device block) pairs ``[n, 2]`` int64: swap pool -> device."""
        self._swap(self.cpu_cache, self.gpu_cache, mapping)

    def copy(self, mapping: np.ndarray) -> None:
        """(src, dst) device block pairs ``[n, 2]`` int64 (copy-on-write), all layers at once."""
        if len(mapping) == 0:
            return
        ops.copy_blocks([k for k, _ in self.gpu_cache], [v for _, v in self.gpu_cache], torch.from_numpy(mapping))

    @staticmethod
    def _swap(src: list, dst: list, mapping: np.ndarray) -> None:
        if len(mapping) == 0:
            return
        pairs = torch.from_numpy(mapping)
        for (src_k, src_v), (dst_k, dst_v) in zip(src, dst):
            ops.swap_blocks(src_k, dst_k, pairs)
            ops.swap_blocks(src_v, dst_v, pairs)
