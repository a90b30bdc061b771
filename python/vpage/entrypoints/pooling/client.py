"""The pooling engine of a server, run on its own thread: the event loop hands it requests and
awaits their outputs; the thread batches whatever has arrived into each step (continuous
batching under the engine's token budget). The engine's kernels release the GIL, so the loop
keeps answering while a step runs.

A request whose awaiting task is cancelled (its client left) is aborted in the engine. If a
step raises, every request in flight fails with that error and the client is marked dead."""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from vpage.outputs import PoolingRequestOutput
from vpage.pooling_params import PoolingParams


class PoolingEngineDead(RuntimeError):
    pass


class PoolingAborted(RuntimeError):
    """The request was aborted before it finished (the server drains)."""


@dataclass
class PoolingInfo:
    """What the server checks prompts against."""

    max_model_len: int
    vocab_size: int


@dataclass
class _Job:
    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams
    token_type_ids: Optional[list[int]]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    arrival: float


class PoolingClient:
    """``engine`` (a PoolingEngine) stepped on a thread; ``on_step(num_running, num_waiting,
    finished)`` is called on the event loop after each step (and each idle wait), with the
    (arrival time, output) of each request the step finished (metrics)."""

    def __init__(self, engine: Any, on_step: Optional[Callable[[int, int, list], None]] = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.info = PoolingInfo(engine.max_model_len, engine.vocab_size)
        self.on_step = on_step
        self.dead_reason: Optional[str] = None
        self.on_dead: Optional[Callable[[str], None]] = None  # called on the event loop when a step fails
        self.pid = os.getpid()
        self._ids = itertools.count()
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[str, _Job] = {}  # in the engine, by request id (the thread's own)
        self._unfinished = 0  # submitted, not yet answered (read by the event loop)
        self._last_beat = time.monotonic()
        self._stop = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread = threading.Thread(target=self._run, name="vpage-pooling", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- event loop side

    async def encode(self, prompt_token_ids: list[int], params: PoolingParams,
                     token_type_ids: Optional[list[int]] = None) -> PoolingRequestOutput:
        """The pooled output of one prompt; ValueError for a prompt the engine refuses."""
        if self.dead_reason is not None:
            raise PoolingEngineDead(self.dead_reason)
        loop = self._loop = asyncio.get_running_loop()  # one event loop serves every request
        job = _Job(f"pool-{next(self._ids)}", prompt_token_ids, params, token_type_ids, loop.create_future(), loop,
                   time.monotonic())
        self._unfinished += 1
        self._inbox.put(job)
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            self._inbox.put(("abort", job.request_id))
            raise
        finally:
            self._unfinished -= 1

    def num_unfinished(self) -> int:
        return self._unfinished

    def num_waiting_estimate(self) -> int:
        return self._unfinished

    def abort_all(self) -> None:
        self._inbox.put(("abort_all", None))

    def health(self, stall_s: float) -> Optional[str]:
        """None when healthy; else why not (dead, or a step running longer than ``stall_s``)."""
        if self.dead_reason is not None:
            return self.dead_reason
        if self._unfinished and time.monotonic() - self._last_beat > stall_s:
            return f"the pooling engine has not finished a step in {stall_s:.0f} s"
        return None

    async def shutdown(self) -> None:
        self._stop = True
        self._inbox.put(("stop", None))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    # ---------------------------------------------------------------- engine thread

    def _take(self, item: Any) -> None:
        if isinstance(item, _Job):
            try:
                self.engine.add_request(item.request_id, item.prompt_token_ids, item.params,
                                        token_type_ids=item.token_type_ids)
            except ValueError as exc:
                self._answer(item, error=exc)
                return
            self._jobs[item.request_id] = item
            return
        command, request_id = item
        ids = list(self._jobs) if command in ("abort_all", "stop") else [request_id]
        ids = [rid for rid in ids if rid in self._jobs]
        if ids:
            self.engine.abort_request(ids)
        for rid in ids:
            self._answer(self._jobs.pop(rid), error=PoolingAborted("the request was aborted"))

    def _answer(self, job: _Job, output: Any = None, error: Optional[BaseException] = None) -> None:
        def settle() -> None:
            if job.future.done():
                return
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(output)

        job.loop.call_soon_threadsafe(settle)

    def _run(self) -> None:
        while not self._stop:
            block = not self._jobs
            try:
                self._take(self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait())
                while True:  # everything that arrived joins this step
                    self._take(self._inbox.get_nowait())
            except queue.Empty:
                pass
            self._last_beat = time.monotonic()
            finished = []
            if self._jobs:
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - every request in flight learns why
                    self._fail(f"the pooling engine failed: {exc}")
                    return
                self._last_beat = time.monotonic()
                for out in outputs:
                    job = self._jobs.pop(out.request_id, None)
                    if job is not None:
                        self._answer(job, out)
                        finished.append((job.arrival, out))
            if self.on_step is not None and self._loop is not None:  # also after aborts, and when idle
                self._loop.call_soon_threadsafe(self.on_step, len(self._jobs), self._inbox.qsize(), finished)

    def _fail(self, reason: str) -> None:
        self.dead_reason = reason
        for job in self._jobs.values():
            self._answer(job, error=PoolingEngineDead(reason))
        self._jobs.clear()
        if self.on_dead is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_dead, reason)
