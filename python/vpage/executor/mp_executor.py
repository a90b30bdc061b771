"""``mp``: one spawned process per extra rank on this machine.

Each worker holds one end of a pipe whose other end only the driver holds: a thread in the
worker waits on it and exits the process when it closes (the driver ended, however it
ended), and the worker reports a failure through it before exiting. Workers ignore Ctrl-C
(the driver handles it and stops them) and are daemonic, so a driver that exits normally
takes them down too.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import traceback
import types
from typing import Iterator

from vpage.config import EngineConfig
from vpage.executor.tensor_parallel import TensorParallelExecutor, timeout_s

_JOIN_S = 5.0


def _watch_driver(conn) -> None:
    try:
        conn.recv()  # the driver never sends: this returns only when its end closes
    except (EOFError, OSError):
        pass
    os._exit(0)


def run_worker(config: EngineConfig, rank: int, init_method: str, backend: str, timeout: float) -> None:
    """A worker rank's whole life: join, load, size the cache with the others, serve steps."""
    from vpage.worker.worker import init_worker

    worker = init_worker(config, rank, init_method, backend, timeout)
    worker.init_cache(*worker.determine_num_blocks())
    worker.serve_steps()


def _worker_main(config: EngineConfig, rank: int, init_method: str, backend: str, timeout: float, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_driver, args=(conn,), daemon=True).start()
    try:
        run_worker(config, rank, init_method, backend, timeout)
    except BaseException as e:  # report, then leave at once (the group is unusable)
        try:
            conn.send(f"rank {rank} raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


@contextlib.contextmanager
def _bare_main() -> Iterator[None]:
    """Spawned workers run only vpage code: hide the caller's __main__ so a script without an
    ``if __name__ == "__main__"`` guard is not run again in each worker."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class MPExecutor(TensorParallelExecutor):
    def _start_workers(self, init_method: str) -> None:
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for rank in range(1, self.config.parallel.world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_worker_main, name=f"vpage-tp-worker-{rank}", daemon=True,
                               args=(self.config, rank, init_method, self.backend, timeout_s(), child))
            with _bare_main():
                proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _dead_workers(self) -> list[str]:
        dead = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if proc.exitcode is None:
                continue
            message = ""
            try:
                if conn.poll():
                    message = ": " + conn.recv().strip()
            except (EOFError, OSError):
                pass
            code = proc.exitcode
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            dead.append(f"rank {rank} (pid {proc.pid}) {how}{message}")
        return dead

    def _stop_workers(self, graceful: bool) -> None:
        if graceful:
            for proc in self.procs:
                proc.join(_JOIN_S)
        for conn in self.conns:
            conn.close()  # a worker stuck in a collective exits through its watcher
        for proc in self.procs:
            proc.join(1.0)
            if proc.exitcode is None:
                proc.kill()
                proc.join(_JOIN_S)
