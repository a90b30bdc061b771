"""The one interface the engine drives, whatever runs the model: ``Executor.create(config)``
builds the workers, sizes and allocates their KV caches, and then runs plans.

Implementations: ``UniProcExecutor`` (one worker in the engine's process), and for tensor
parallelism ``MPExecutor`` (local worker processes) and ``RayExecutor`` (Ray actors), both on
``TensorParallelExecutor`` (rank 0, the driver, in the engine's process).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from vpage.config import EngineConfig
from vpage.model_executor.config import ModelConfig
from vpage.worker.worker import Worker


class Executor:
    """Runs plans on the workers. ``driver_worker`` is the worker in this process (rank 0): its
    model, tokenizer and KV cache are the ones the engine can inspect."""

    driver_worker: Worker
    num_gpu_blocks: int
    num_cpu_blocks: int

    @staticmethod
    def create(config: EngineConfig) -> "Executor":
        """The executor ``config.parallel`` asks for, with its workers loaded and caches allocated."""
        backend = config.parallel.distributed_executor_backend
        if config.parallel.tensor_parallel_size == 1:
            from vpage.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor(config)
        if backend == "ray":
            from vpage.executor.ray_executor import RayExecutor

            return RayExecutor(config)
        from vpage.executor.mp_executor import MPExecutor

        return MPExecutor(config)

    @property
    def model_config(self) -> ModelConfig:
        return self.driver_worker.loaded.config

    @property
    def tokenizer(self) -> Any:
        return self.driver_worker.loaded.tokenizer

    @property
    def device(self) -> torch.device:
        return self.driver_worker.device

    def block_bytes(self) -> int:
        """Bytes of one KV block on one rank."""
        return self.driver_worker.block_bytes()

    def execute(self, plan, logit_rows: Optional[np.ndarray] = None) -> Optional[torch.Tensor]:
        """Runs ``plan`` (block moves, then the forward); the float32 logits of its sampled rows,
        then of ``logit_rows`` (int64 token indices: prompt rows), None without rows."""
        raise NotImplementedError

    def propose_drafts(self, plan, inputs) -> np.ndarray:
        """Speculative decoding's draft model (whole, on the driver): the plan's block operations, then
        greedy drafts for ``inputs`` (a ``DraftInputs``); ``execute`` of the plan follows."""
        return self.driver_worker.propose_drafts(plan, inputs)

    def check_health(self) -> None:
        """Raises WorkerDiedError when a worker has died (the engine must be recreated)."""

    def shutdown(self) -> None:
        """Stops the workers (idempotent); the executor cannot run plans afterwards."""
