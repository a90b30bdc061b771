"""The tensor-parallel group of this process and the collectives the sharded layers use.

Size 1 (the default, no process group) makes every collective a no-op, so a model built
without tensor parallelism runs exactly the single-process code. ``init_tensor_parallel``
sets rank and size before the model is built; the layers read them at construction.
Each collective adds its wall time to ``COMM_TIME`` (seconds), which the benchmark reads.
CPU ranks on one machine sum through shared memory (``shm_comm``); everything else goes
through torch.distributed (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from vpage.distributed import shm_comm


@dataclass
class _State:
    rank: int = 0
    size: int = 1
    control: Optional[dist.ProcessGroup] = None  # the step header broadcast (long timeout: idle workers wait)
    shm: Optional[shm_comm.ShmCommunicator] = None  # all-reduce of CPU tensors when every rank is on this machine


_STATE = _State()


@dataclass
class CommTimes:
    """Seconds spent in collectives since the last ``reset``."""

    all_reduce: float = 0.0
    gather: float = 0.0
    broadcast: float = 0.0

    def reset(self) -> None:
        self.all_reduce = self.gather = self.broadcast = 0.0


COMM_TIME = CommTimes()


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str, timeout_s: float) -> None:
    """Joins the process group of ``size`` ranks (``init_method`` a tcp:// address). The model's
    collectives time out after ``timeout_s`` (a backstop: a dead peer normally errors at
    once); the step header broadcast, where idle workers wait, after a week. With gloo, the
    all-reduce goes through shared memory when the ranks share this machine (VPAGE_TP_ALLREDUCE)."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    _STATE.rank, _STATE.size = rank, size
    _STATE.control = dist.new_group(list(range(size)), timeout=timedelta(days=7), backend=backend)
    if backend == "gloo":
        _STATE.shm = shm_comm.connect(rank, size, timeout_s)


def set_tensor_parallel_for_testing(rank: int, size: int) -> None:
    """Rank and size without a process group (to build one rank's shard alone)."""
    _STATE.rank, _STATE.size = rank, size


@contextlib.contextmanager
def single_rank() -> Iterator[None]:
    """Builds a model unsharded even while a tensor-parallel engine lives in this process
    (layers read rank and size when they are built)."""
    saved = _STATE.rank, _STATE.size
    _STATE.rank, _STATE.size = 0, 1
    try:
        yield
    finally:
        _STATE.rank, _STATE.size = saved


def is_active() -> bool:
    """Whether this process is in a tensor-parallel group now."""
    return _STATE.control is not None


def all_reduce_transport() -> str:
    """What sums CPU tensors over the ranks: "shm", "gloo" (or "nccl"), or "none" without a group."""
    if _STATE.shm is not None:
        return "shm"
    return dist.get_backend() if dist.is_initialized() else "none"


def destroy_tensor_parallel() -> None:
    shm, _STATE.shm = _STATE.shm, None
    if shm is not None:
        shm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE.rank, _STATE.size, _STATE.control = 0, 1, None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums ``x`` over the ranks, in place; returns it."""
    if _STATE.size == 1:
        return x
    start = time.perf_counter()
    if _STATE.shm is not None and _STATE.shm.handles(x):
        _STATE.shm.all_reduce(x)
    else:
        dist.all_reduce(x)
    COMM_TIME.all_reduce += time.perf_counter() - start
    return x


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's ``value``."""
    if _STATE.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_to_driver(x: torch.Tensor) -> Optional[torch.Tensor]:
    """Concatenates every rank's ``x`` along the last dim on rank 0 (None elsewhere)."""
    if _STATE.size == 1:
        return x
    start = time.perf_counter()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.size)] if _STATE.rank == 0 else None
    dist.gather(x, parts, dst=0)
    COMM_TIME.gather += time.perf_counter() - start
    return torch.cat(parts, dim=-1) if parts is not None else None


def broadcast(x: torch.Tensor, control: bool = False) -> torch.Tensor:
    """Rank 0's ``x`` into every rank's ``x`` (in place); ``control`` uses the long-timeout group."""
    start = time.perf_counter()
    dist.broadcast(x, src=0, group=_STATE.control if control else None)
    COMM_TIME.broadcast += time.perf_counter() - start
    return x


def _collective_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
