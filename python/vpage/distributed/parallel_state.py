"""The model-parallel groups of this process and the collectives the sharded layers use.

Size 1 (the default, no process group) makes every collective a no-op, so a model built
without parallelism runs exactly the single-process code. ``init_tensor_parallel`` sets ranks
and sizes before the model is built; the layers read them at construction.

Ranks: ``pipeline_size`` stages of ``size`` tensor-parallel ranks each; global rank
``stage * size + tp_rank``. Rank 0 (stage 0, tensor rank 0) is the driver. The model's
collectives run in the stage's tensor-parallel group; the step broadcast (``control``) and the
block-count agreement span every rank; stages pass activations point to point (``send``,
``recv``) to the same tensor rank of the next stage.
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
    rank: int = 0  # tensor-parallel rank within the stage
    size: int = 1  # tensor-parallel size
    pp_rank: int = 0  # pipeline stage
    pp_size: int = 1
    pp_layers: tuple[int, ...] = ()  # decoder layers of each virtual stage (pp_size > 1)
    tp_group: Optional[dist.ProcessGroup] = None  # this stage's tensor-parallel ranks
    control: Optional[dist.ProcessGroup] = None  # the step header broadcast (long timeout: idle workers wait)
    shm: Optional[shm_comm.ShmCommunicator] = None  # all-reduce of CPU tensors when every rank is on this machine


_STATE = _State()


@dataclass
class CommTimes:
    """Seconds spent in collectives since the last ``reset``."""

    all_reduce: float = 0.0
    gather: float = 0.0
    broadcast: float = 0.0
    send_recv: float = 0.0  # between pipeline stages (waiting included)

    def reset(self) -> None:
        self.all_reduce = self.gather = self.broadcast = self.send_recv = 0.0


COMM_TIME = CommTimes()


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def pp_rank() -> int:
    return _STATE.pp_rank


def pp_size() -> int:
    return _STATE.pp_size


def is_first_stage() -> bool:
    return _STATE.pp_rank == 0


def is_last_stage() -> bool:
    return _STATE.pp_rank == _STATE.pp_size - 1


def virtual_stages() -> int:
    """Layer ranges each pipeline stage holds (interleaved: virtual stage j on stage j % pp_size)."""
    return max(1, len(_STATE.pp_layers) // _STATE.pp_size)


def stage_layers(num_layers: int) -> list[tuple[int, int]]:
    """The decoder layer ranges ``[start, end)`` of this pipeline stage, in order: virtual stages
    ``pp_rank``, ``pp_rank + pp_size``, ... of the model's consecutive layer ranges (all the
    layers with one stage)."""
    if _STATE.pp_size == 1:
        return [(0, num_layers)]
    counts = _STATE.pp_layers
    if sum(counts) != num_layers:
        raise ValueError(f"the pipeline stages hold {sum(counts)} layers, the model has {num_layers}")
    starts = [sum(counts[:j]) for j in range(len(counts))]
    return [(starts[j], starts[j] + counts[j]) for j in range(_STATE.pp_rank, len(counts), _STATE.pp_size)]


def init_tensor_parallel(rank: int, size: int, init_method: str, backend: str, timeout_s: float,
                         pipeline_layers: tuple[int, ...] = (), pipeline_size: int = 1) -> None:
    """Joins the process group of ``size`` tensor-parallel ranks times ``pipeline_size`` stages
    (over which the virtual stages of ``pipeline_layers`` decoder layers each go round) as global ``rank``
    (``init_method`` a tcp:// address). The model's collectives time out after ``timeout_s``
    (a backstop: a dead peer normally errors at once); the step header broadcast, where idle
    workers wait, after a week. With gloo, the all-reduce goes through shared memory when a
    stage's ranks share this machine (VPAGE_TP_ALLREDUCE)."""
    world = size * pipeline_size
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    _STATE.pp_rank, _STATE.rank = divmod(rank, size)
    _STATE.size, _STATE.pp_size, _STATE.pp_layers = size, pipeline_size, tuple(pipeline_layers)
    _STATE.control = dist.new_group(list(range(world)), timeout=timedelta(days=7), backend=backend)
    for stage in range(pipeline_size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(stage * size, (stage + 1) * size)), backend=backend)
        if stage == _STATE.pp_rank:
            _STATE.tp_group = group
    if backend == "gloo" and size > 1:
        _STATE.shm = shm_comm.connect(_STATE.rank, size, timeout_s, _STATE.tp_group, _STATE.pp_rank * size)


def set_tensor_parallel_for_testing(rank: int, size: int) -> None:
    """Rank and size without a process group (to build one rank's shard alone)."""
    _STATE.rank, _STATE.size = rank, size


@contextlib.contextmanager
def single_rank() -> Iterator[None]:
    """Builds a model unsharded and whole even while a parallel engine lives in this process
    (layers read ranks and sizes when they are built)."""
    saved = _STATE.rank, _STATE.size, _STATE.pp_rank, _STATE.pp_size
    _STATE.rank, _STATE.size, _STATE.pp_rank, _STATE.pp_size = 0, 1, 0, 1
    try:
        yield
    finally:
        _STATE.rank, _STATE.size, _STATE.pp_rank, _STATE.pp_size = saved


def is_active() -> bool:
    """Whether this process is in a model-parallel group now."""
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
    _STATE.rank, _STATE.size, _STATE.pp_rank, _STATE.pp_size, _STATE.pp_layers = 0, 1, 0, 1, ()
    _STATE.control = _STATE.tp_group = None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums ``x`` over the ranks, in place; returns it."""
    if _STATE.size == 1:
        return x
    start = time.perf_counter()
    if _STATE.shm is not None and _STATE.shm.handles(x):
        _STATE.shm.all_reduce(x)
    else:
        dist.all_reduce(x, group=_STATE.tp_group)
    COMM_TIME.all_reduce += time.perf_counter() - start
    return x


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's ``value`` (every stage's)."""
    if _STATE.control is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_to_driver(x: torch.Tensor) -> Optional[torch.Tensor]:
    """Concatenates every tensor rank's ``x`` along the last dim on the stage's tensor rank 0
    (None elsewhere)."""
    if _STATE.size == 1:
        return x
    start = time.perf_counter()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.size)] if _STATE.rank == 0 else None
    dist.gather(x, parts, dst=_STATE.pp_rank * _STATE.size, group=_STATE.tp_group)
    COMM_TIME.gather += time.perf_counter() - start
    return torch.cat(parts, dim=-1) if parts is not None else None


def broadcast(x: torch.Tensor, control: bool = False) -> torch.Tensor:
    """Rank 0's ``x`` into every rank's ``x`` (in place); ``control`` uses the long-timeout group."""
    start = time.perf_counter()
    dist.broadcast(x, src=0, group=_STATE.control if control else None)
    COMM_TIME.broadcast += time.perf_counter() - start
    return x


def stage_rank(stage: int) -> int:
    """The global rank of this rank's tensor-parallel peer in pipeline ``stage``."""
    return stage * _STATE.size + _STATE.rank


def send(x: torch.Tensor, dst: int, tag: int = 0) -> "dist.Work":
    """Starts sending ``x`` to global rank ``dst``; the caller waits on the returned work (and
    keeps ``x`` unchanged until then). Messages of one ``tag`` between two ranks arrive in order."""
    return dist.isend(x.contiguous(), dst, tag=tag)


def start_recv(x: torch.Tensor, src: int, tag: int = 0) -> "dist.Work":
    """Starts receiving global rank ``src``'s next tensor of ``tag`` into ``x``; wait on the work."""
    return dist.irecv(x, src, tag=tag)


def recv(x: torch.Tensor, src: int) -> torch.Tensor:
    """Receives global rank ``src``'s tensor into ``x``."""
    start = time.perf_counter()
    dist.recv(x, src)
    COMM_TIME.send_recv += time.perf_counter() - start
    return x


def _collective_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
