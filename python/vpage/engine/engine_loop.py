"""Runs an LLMEngine on a background thread for callers on other threads (the API server).

One lock guards the engine: ``add_request`` and ``abort`` wait at most one step. Each request
gets a :class:`RequestStream` that yields its outputs (cumulative, as ``step`` returns them)
until it finishes or is aborted.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Iterator, Optional

from vpage.engine.llm_engine import LLMEngine, PromptType
from vpage.outputs import RequestOutput
from vpage.sampling_params import SamplingParams

logger = logging.getLogger("vpage")

_END = object()  # queued after the last output of a stream


class EngineDeadError(RuntimeError):
    """A step raised: the engine's state is unknown, so every request was aborted."""


class RequestStream:
    """The outputs of one request, in order. Iterating blocks until the next output; it
    ends after the finished output, or early when the request is aborted."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: queue.Queue = queue.Queue()

    def _put(self, item) -> None:
        self._queue.put(item)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


class EngineLoop:
    """Steps ``engine`` whenever it has unfinished requests; idle otherwise."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="vpage-engine-loop", daemon=True)
        self._thread.start()

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> RequestStream:
        """Queues a request; raises ValueError (engine unchanged) like ``LLMEngine.add_request``."""
        stream = RequestStream(request_id)
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(f"the engine failed earlier: {self._error}")
            self.engine.add_request(request_id, prompt, params)
            self._streams[request_id] = stream
            self._has_work.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Aborts the request if it is still running (frees its blocks) and ends its stream."""
        with self._lock:
            self.engine.abort_request(request_id)
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._put(_END)

    def num_unfinished_requests(self) -> int:
        with self._lock:
            return self.engine.get_num_unfinished_requests()

    def shutdown(self) -> None:
        """Stops the thread after the current step; unfinished requests are aborted."""
        with self._lock:
            self._stopping = True
            self._has_work.notify()
        self._thread.join()
        with self._lock:
            self.engine.abort_request(list(self._streams))
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream._put(_END)
        self.engine.shutdown()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.engine.has_unfinished_requests():
                    self._has_work.wait()
                if self._stopping:
                    return
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - reported to every waiting request
                    logger.exception("vpage: engine step failed; aborting every request")
                    self._error = exc
                    self.engine.abort_request(list(self.engine.requests))
                    streams, self._streams = list(self._streams.values()), {}
                    for stream in streams:
                        stream._put(EngineDeadError(f"engine step failed: {exc}"))
                    return
                delivered = [(self._streams.get(out.request_id), out) for out in outputs]
                for out in outputs:
                    if out.finished:
                        self._streams.pop(out.request_id, None)
            for stream, out in delivered:
                if stream is not None:
                    stream._put(out)
