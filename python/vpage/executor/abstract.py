"""The one interface the engine drives, whatever runs the model: ``Executor.create(config)``
builds the workers, sizes and allocates their KV caches, and then runs plans.

Implementations: ``UniProcExecutor`` (one worker in the engine's process), and for tensor and
pipeline parallelism ``MPExecutor`` (local worker processes) and ``RayExecutor`` (Ray actors),
both on ``TensorParallelExecutor`` (rank 0, the driver, in the engine's process).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from vpage.config import EngineConfig
from vpage.model_executor.config import ModelConfig
from vpage.worker.step_io import DraftRequest, ModelRunnerOutput, SamplingMetadata
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
        if config.parallel.world_size == 1:
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

    def execute(self, plan, sampling: Optional[SamplingMetadata],
                drafts: Optional[DraftRequest] = None) -> Optional[ModelRunnerOutput]:
        """Runs ``plan`` on every worker: block moves, the draft model's proposals (``drafts``,
        written into the plan first), the forward, then sampling as ``sampling`` says (given
        whenever the plan has rows). The driver's output; None without rows."""
        raise NotImplementedError

    def take_kv_loads(self, wait_s: float = 0.0) -> tuple[list, list]:
        """The disk tier's loads that finished since the last call, (read, failed): the driver
        rank's files (the disk tier runs on one rank)."""
        return self.driver_worker.take_kv_loads(wait_s)

    def add_lora(self, request: Any) -> bool:
        """Loads a LoRA adapter (a ``LoRARequest``) on the workers; True when it was read now.
        ValueError or FileNotFoundError for one that cannot serve the model."""
        return self.driver_worker.add_lora(request)

    def remove_lora(self, adapter_id: int) -> bool:
        return self.driver_worker.remove_lora(adapter_id)

    def list_loras(self) -> list[int]:
        return self.driver_worker.list_loras()

    def check_health(self) -> None:
        """Raises WorkerDiedError when a worker has died (the engine must be recreated)."""

    def shutdown(self) -> None:
        """Stops the workers (idempotent); the executor cannot run plans afterwards."""
        worker = getattr(self, "driver_worker", None)
        if worker is not None:
            worker.close()
