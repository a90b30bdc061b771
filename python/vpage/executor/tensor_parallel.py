"""The driver side of tensor and pipeline parallelism, shared by the ``mp`` and ``ray``
executors.

The driver is rank 0 in the engine's process. Each step it prepares the plan (block moves, a
draft model's proposals), broadcasts it once (``step_message``), runs its own shard and samples
from the logits gathered from every rank; its output is the step's.
A rank that dies or fails makes the step raise ``WorkerDiedError`` (gloo reports a closed
peer at once; the executor also checks its workers before each step, and the process
group's timeout is the backstop), after which the executor is closed and every worker
stopped.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import time
import weakref
from typing import Optional

import torch

from vpage.config import EngineConfig
from vpage.distributed import parallel_state as ps
from vpage.distributed.shm_comm import requested_mode
from vpage.distributed.step_message import LoraUpdate, StepSender, has_work, send_lora_update, send_shutdown
from vpage.executor.abstract import Executor
from vpage.executor.errors import WorkerDiedError
from vpage.worker.model_runner import extra_logit_rows
from vpage.worker.step_io import DraftRequest, ModelRunnerOutput, SamplingMetadata
from vpage.worker.worker import Worker, init_worker

logger = logging.getLogger("vpage")


def timeout_s() -> float:
    """Backstop timeout of the model's collectives (seconds; VPAGE_TP_TIMEOUT_S, default 120)."""
    return float(os.environ.get("VPAGE_TP_TIMEOUT_S", "120"))


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _shutdown_at_exit(ref: "weakref.ref[TensorParallelExecutor]") -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()


class TensorParallelExecutor(Executor):
    """Starts ``world_size - 1`` workers (subclasses say how), then joins the group as rank 0:
    ``driver_worker`` is this process's Worker (model shard and stage, cache slice)."""

    host = "127.0.0.1"

    def __init__(self, config: EngineConfig):
        if ps.is_active():
            raise ValueError("another tensor-parallel engine is running in this process: shut it down first "
                             "(LLMEngine.shutdown)")
        requested_mode()  # a bad VPAGE_TP_ALLREDUCE fails here, not in the ranks
        self.config = config
        self.backend = "nccl" if config.model.device == "cuda" else "gloo"
        self.closed = False
        self.error: Optional[str] = None
        init_method = f"tcp://{self.host}:{free_port(self.host)}"
        self._start_workers(init_method)
        try:
            self.driver_worker: Worker = init_worker(config, 0, init_method, self.backend, timeout_s())
            self.num_gpu_blocks, self.num_cpu_blocks = self.driver_worker.determine_num_blocks()
            self.driver_worker.init_cache(self.num_gpu_blocks, self.num_cpu_blocks)
        except BaseException as e:
            self._fail(e)
        self._device = self.driver_worker.device if self.backend == "nccl" else torch.device("cpu")
        self._sender = StepSender(self._device, config.cache.block_size)
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    # Subclasses: start the workers, report dead ones, stop them all.
    def _start_workers(self, init_method: str) -> None:
        raise NotImplementedError

    def _dead_workers(self) -> list[str]:
        """A description of each worker that has ended (exit code, error)."""
        raise NotImplementedError

    def _stop_workers(self, graceful: bool) -> None:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raises WorkerDiedError if the executor is shut down or a worker has ended (cheap:
        process or actor liveness; a server calls it between steps too)."""
        if self.closed:
            raise WorkerDiedError(self.error or "the tensor-parallel executor is shut down")
        dead = self._dead_workers()
        if dead:
            self._fail(None, dead)

    def execute(self, plan, sampling: Optional[SamplingMetadata],
                drafts: Optional[DraftRequest] = None) -> Optional[ModelRunnerOutput]:
        """Runs ``plan`` on every rank. Every rank computes the logits of the same rows (they
        are gathered across ranks), so the rows besides the sampled ones travel in the step
        message, which goes out once the drafts are in the plan."""
        self.check_health()
        if not has_work(plan):
            return None
        try:
            self.driver_worker.prepare(plan, drafts)
            self._sender.send(plan, extra_logit_rows(plan, sampling))
            return self.driver_worker.run(plan, sampling)
        except BaseException as e:
            self._fail(e)

    def add_lora(self, request) -> bool:
        """Loads the adapter on the driver (which checks it), then on every other rank."""
        self.check_health()
        added = self.driver_worker.add_lora(request)
        if added:
            self._broadcast_lora(LoraUpdate(add=request))
        return added

    def remove_lora(self, adapter_id: int) -> bool:
        self.check_health()
        removed = self.driver_worker.remove_lora(adapter_id)
        if removed:
            self._broadcast_lora(LoraUpdate(remove=adapter_id))
        return removed

    def _broadcast_lora(self, update: LoraUpdate) -> None:
        try:
            send_lora_update(self._device, update)
        except BaseException as e:
            self._fail(e)

    def _fail(self, error: Optional[BaseException], dead: Optional[list[str]] = None) -> None:
        dead = dead if dead is not None else self._wait_for_dead()
        if isinstance(error, KeyboardInterrupt):
            self.shutdown(graceful=False)
            raise error
        detail = "; ".join(dead) if dead else f"{type(error).__name__}: {error}"
        self.error = f"tensor-parallel worker failure ({detail}): the engine must be recreated"
        self.shutdown(graceful=False)
        raise WorkerDiedError(self.error) from error

    def _wait_for_dead(self) -> list[str]:
        """Dead workers, giving a worker that is going down a moment to exit."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            dead = self._dead_workers()
            if dead:
                return dead
            time.sleep(0.05)
        return []

    def shutdown(self, graceful: bool = True) -> None:
        """Stops every worker (idempotent). ``graceful`` first asks them to leave their loop."""
        if self.closed:
            return
        self.closed = True
        if graceful and not self._dead_workers():
            try:
                send_shutdown(self._device)
            except Exception:  # a worker already gone: stop them below
                graceful = False
        self._stop_workers(graceful)
        try:
            ps.destroy_tensor_parallel()
        except Exception:  # noqa: BLE001 -- the group may be broken by a dead peer
            ps.set_tensor_parallel_for_testing(0, 1)
