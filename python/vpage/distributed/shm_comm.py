"""All-reduce through shared memory between the tensor-parallel ranks of one machine.

gloo sums over loopback TCP (about 0.4 ms even for 4 bytes on a small VM); ranks that share a
machine can sum through memory they all map instead (``vpage._core._ShmAllReduce``; the
protocol is described in cpp/include/vpage/shm_allreduce.h). Rank 0 creates a file under
/dev/shm with a random name, the others open it by the name rank 0 sends over gloo, and rank 0
unlinks it as soon as every rank has mapped it: the memory lives while some process maps it,
and no name is left behind however the processes end.

A dead peer would leave the others waiting: the wait returns every ``POLL_S`` seconds to check
that the peers' processes still run, and gives up after the group's timeout.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import time
from typing import Optional

import psutil
import torch
import torch.distributed as dist

from vpage import _core

logger = logging.getLogger("vpage")

MODES = ("auto", "shm", "gloo")
SHM_DIR = "/dev/shm"
SLOT_BYTES = 1 << 20  # per rank and parity: larger tensors go in chunks of this size
POLL_S = 0.5
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def requested_mode() -> str:
    """VPAGE_TP_ALLREDUCE: ``auto`` (shm when every rank is on this machine, else gloo; the
    default), ``shm`` (an error when it cannot be used) or ``gloo``. Rank 0's value holds."""
    mode = os.environ.get("VPAGE_TP_ALLREDUCE", "auto")
    if mode not in MODES:
        raise ValueError(f"VPAGE_TP_ALLREDUCE must be one of {MODES}, got {mode!r}")
    return mode


def _machine() -> Optional[tuple]:
    """What ranks that can share memory and see each other's pids have in common (None where unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        pid_namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
    return socket.gethostname(), boot_id, pid_namespace


class ShmCommunicator:
    """This rank's mapping of the segment; ``all_reduce`` sums CPU tensors in place."""

    def __init__(self, mapping: mmap.mmap, rank: int, pids: list[int], slot_bytes: int, timeout_s: float):
        self._map = mapping
        self._view = torch.frombuffer(mapping, dtype=torch.uint8)  # its data_ptr is the mapping's address
        self._comm = _core._ShmAllReduce(self._view.data_ptr(), len(mapping), rank, len(pids), slot_bytes)
        self._peers = [(r, pid) for r, pid in enumerate(pids) if r != rank]
        self.timeout_s = timeout_s

    @staticmethod
    def handles(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in _DTYPE_CODES

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sums ``x`` (CPU, float32/float16/bfloat16) over the ranks in place; raises RuntimeError
        when a peer's process has ended or the peers do not arrive within the timeout."""
        y = x if x.is_contiguous() else x.contiguous()
        deadline = time.monotonic() + self.timeout_s
        while not self._comm.all_reduce(y.data_ptr(), y.numel(), _DTYPE_CODES[y.dtype], POLL_S):
            gone = self._gone_peers()
            if gone:
                raise RuntimeError(f"shm all-reduce: {', '.join(gone)} ended while this rank waited for it")
            if time.monotonic() > deadline:
                raise RuntimeError(f"shm all-reduce: the other ranks did not arrive within {self.timeout_s:g} s")
        if y is not x:
            x.copy_(y)

    def _gone_peers(self) -> list[str]:
        gone = []
        for rank, pid in self._peers:
            try:
                ended = psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
            except psutil.NoSuchProcess:
                ended = True
            if ended:
                gone.append(f"rank {rank} (pid {pid})")
        return gone

    def close(self) -> None:
        self._comm = self._view = None
        self._map.close()


def connect(rank: int, size: int, timeout_s: float, group: Optional[dist.ProcessGroup] = None, first: int = 0,
            slot_bytes: int = SLOT_BYTES) -> Optional[ShmCommunicator]:
    """A collective over ``group`` (gloo; None: the default group) whose ranks are global
    ``first`` to ``first + size - 1``, this one ``rank`` of them: a communicator on every rank
    when all are on this machine and the first one's mode allows it, None on every rank
    otherwise (gloo then does the all-reduce). Raises on every rank when the mode is ``shm``
    and it cannot be used."""
    infos = [None] * size
    dist.all_gather_object(infos, (requested_mode(), _machine(), os.getpid()), group=group)
    mode = infos[0][0]
    one_machine = infos[0][1] is not None and all(info[1] == infos[0][1] for info in infos)
    if mode == "gloo" or (mode == "auto" and not one_machine):
        return None
    if not one_machine:
        raise RuntimeError("VPAGE_TP_ALLREDUCE=shm needs every tensor-parallel rank on this machine")
    mapping, found = _share_segment(rank, size, _core._ShmAllReduce.segment_bytes(size, slot_bytes), group, first)
    if isinstance(found[0], tuple) and all(f == found[0] for f in found):
        return ShmCommunicator(mapping, rank, [info[2] for info in infos], slot_bytes, timeout_s)
    if mapping is not None:
        mapping.close()
    problem = "; ".join(f"rank {r}: {f}" for r, f in enumerate(found) if not isinstance(f, tuple)) or \
        "the ranks mapped different files"
    if mode == "shm":
        raise RuntimeError(f"VPAGE_TP_ALLREDUCE=shm: no shared segment ({problem})")
    logger.warning("tensor parallel: no shared-memory segment (%s); all-reduce over gloo", problem)
    return None


def _share_segment(rank: int, size: int, nbytes: int, group: Optional[dist.ProcessGroup],
                   first: int) -> tuple[Optional[mmap.mmap], list]:
    """The group's rank 0 creates the segment, every rank maps it, then rank 0 unlinks it.
    Returns this rank's mapping (None on failure) and what each rank mapped: the file's
    (device, inode), or why not."""
    created, mine, mapping = None, "no segment", None
    if rank == 0:
        try:
            created = _create(nbytes)
        except OSError as e:
            mine = f"cannot create a segment under {SHM_DIR}: {e}"
    try:
        name = [created]
        dist.broadcast_object_list(name, src=first, group=group)
        if name[0] is not None:
            try:
                mapping, mine = _map(name[0], nbytes)
            except (OSError, ValueError) as e:
                mine = f"cannot map {name[0]}: {e}"
        found = [None] * size
        dist.all_gather_object(found, mine, group=group)
    finally:
        if created is not None:
            os.unlink(created)  # every rank has mapped it (or failed to): the name is no longer needed
    return mapping, found


def _create(nbytes: int) -> str:
    path = os.path.join(SHM_DIR, f"vpage-tp-{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # zero-filled, and a full /dev/shm fails here, not with SIGBUS later
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


def _map(path: str, nbytes: int) -> tuple[mmap.mmap, tuple[int, int]]:
    fd = os.open(path, os.O_RDWR)
    try:
        st = os.fstat(fd)
        if st.st_size != nbytes:
            raise ValueError(f"{st.st_size} bytes, not {nbytes}")
        return mmap.mmap(fd, nbytes), (st.st_dev, st.st_ino)
    finally:
        os.close(fd)
