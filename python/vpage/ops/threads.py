"""How many threads the CPU kernels (``vpage._ops_cpu``) run on, and where they come from."""

from __future__ import annotations

from typing import Optional

from vpage import _ops_cpu


def set_num_threads(num_threads: Optional[int]) -> None:
    """Threads of the CPU kernels (None: torch.get_num_threads(), read at each call)."""
    _ops_cpu.set_num_threads(num_threads)


def get_num_threads() -> int:
    """Threads the CPU kernels run on."""
    return _ops_cpu.get_num_threads()


def set_thread_source(source: str) -> str:
    """Where the CPU kernels' threads come from: ``"openmp"`` (the default: torch's OpenMP
    threads, shared with torch's own ops so the two never contend for the cores) or
    ``"own"`` (vpage's thread pool). Returns the OpenMP runtime's file name in use, or ""
    for the own pool (also what ``"openmp"`` gives when no OpenMP runtime is loaded)."""
    return _ops_cpu.set_thread_source(source)
