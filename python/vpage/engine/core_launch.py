"""Where an engine-core process runs: a local process (``mp``), or a Ray actor (``ray``: any
node of a Ray cluster; a data-parallel replica of ``--data-parallel-backend ray``).

Both offer what :class:`~vpage.engine.core_client.EngineCoreClient` needs of the process:
``pid``, ``is_alive()``, ``exit_description()``, ``kill()`` and ``join(timeout)``; the client
binds the ZeroMQ endpoints they connect to (ipc paths for a local process, tcp ports on this
node's address for an actor, which may live on another node).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import threading
from typing import Optional

from vpage.engine.arg_utils import EngineArgs
from vpage.engine.core_process import run_engine_core


class LocalCore:
    """The engine core as a spawned child process, pinned to ``cpu_ids`` when given."""

    def __init__(self, args: EngineArgs, input_address: str, output_address: str,
                 cpu_ids: Optional[list[int]] = None):
        rank = args.data_parallel_rank
        # Not daemonic: with tensor parallelism the engine core starts worker processes, which
        # a daemonic process may not. It still dies with this process (PR_SET_PDEATHSIG and
        # its parent check), and is killed at exit before multiprocessing would join it.
        self._proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(args, input_address, output_address, os.getpid(), cpu_ids),
            name="vpage-engine-core" if rank is None else f"vpage-engine-core-dp{rank}", daemon=False)
        self._proc.start()
        atexit.register(self._proc.kill)
        self.pid = self._proc.pid

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def exit_description(self) -> str:
        return f"exit code {self._proc.exitcode}"

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()

    def join(self, timeout: float) -> None:
        self._proc.join(timeout)


_RAY_INIT = threading.Lock()  # replicas start concurrently: one of them starts Ray


class _CoreActor:
    """The body of a Ray actor that runs one engine core (threaded, so ``pid`` answers while
    ``run`` serves)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, args: EngineArgs, input_address: str, output_address: str) -> None:
        run_engine_core(args, input_address, output_address, None)


class RayCore:
    """The engine core as a Ray actor of ``num_cpus`` CPUs (the local Ray instance is started
    when none is connected). The actor is owned by this process: Ray stops it when it dies."""

    def __init__(self, args: EngineArgs, input_address: str, output_address: str, num_cpus: int):
        import ray

        actor = ray.remote(num_cpus=num_cpus, max_concurrency=2)(_CoreActor)
        rank = args.data_parallel_rank
        self._actor = actor.options(name=None if rank is None else f"vpage-engine-core-dp{rank}-{os.getpid()}").remote()
        self.pid = ray.get(self._actor.pid.remote())
        self._run = self._actor.run.remote(args, input_address, output_address)

    @staticmethod
    def node_address() -> str:
        """This node's address as the cluster sees it (Ray is started here when needed)."""
        import ray

        with _RAY_INIT:
            if not ray.is_initialized():
                ray.init(ignore_reinit_error=True)
        return ray.util.get_node_ip_address()

    def is_alive(self) -> bool:
        import ray

        done, _ = ray.wait([self._run], timeout=0)
        return not done

    def exit_description(self) -> str:
        import ray

        try:
            ray.get(self._run, timeout=0)
            return "the Ray actor returned"
        except Exception as exc:  # noqa: BLE001 - reported as is
            return f"the Ray actor failed: {type(exc).__name__}: {str(exc)[:300]}"

    def kill(self) -> None:
        import ray

        ray.kill(self._actor)

    def join(self, timeout: float) -> None:
        import ray

        ray.wait([self._run], timeout=timeout)
