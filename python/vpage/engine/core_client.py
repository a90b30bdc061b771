"""The API process's side of the engine core: starts the engine-core process, sends it
requests over ZeroMQ, turns its per-step numbers into text (the front end's output processor:
detokenizing, stop strings, logprob tokens, all here, beside the core's compute) and routes the
outputs to one :class:`RequestStream` each. A stop string ends its sample here at once and is
sent to the core, which drops that sample's later tokens.

Everything here runs on the API process's asyncio loop. A watchdog notices when the
engine-core process dies: every stream then fails with :class:`EngineDeadError` and the
``on_dead`` callback runs (the server answers 503 and exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
import uuid
from typing import Any, Callable, Optional, Union

from vpage.engine.arg_utils import EngineArgs
from vpage.engine.core_messages import (AbortRequests, CommandReply, CoreFailed, CoreReady, FinishSequences,
                                        LoraCommand, RequestError, ResetPrefixCache, StepOutputs, decode, encode)
from vpage.engine.core_io import EngineCoreRequest
from vpage.engine.core_launch import LocalCore, RayCore
from vpage.engine.output_processor import OutputProcessor
from vpage.engine.request_state import RequestState
from vpage.lora.request import LoRARequest
from vpage.model_executor.loader.model_loader import load_tokenizer
from vpage.outputs import OutputAccumulator, RequestOutput
from vpage.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("vpage")

_WATCH_S = 0.2


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served."""


class RequestFailed(RuntimeError):
    """The engine refused a request (status 400) or lost it in a failed step (500)."""

    def __init__(self, error: RequestError):
        super().__init__(error.message)
        self.status = error.status


_Ending = Union[None, RequestError, EngineDeadError]  # None: aborted


class RequestStream:
    """The DELTA outputs of one engine request. Deltas that arrive before the reader takes
    them are added up, so a slow reader sees bigger deltas and memory holds only what it has
    not read yet."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.finished = False  # the engine sent the request's last output
        self._pending: Optional[OutputAccumulator] = None
        self._delivered_last = False
        self._ended = False
        self._ending: _Ending = None
        self._event = asyncio.Event()

    def put(self, delta: RequestOutput) -> None:
        """Queues a step's delta for the reader."""
        if self._pending is None:
            self._pending = OutputAccumulator(self.request_id, self.prompt_token_ids)
        self._pending.add(delta)
        self.finished = delta.finished
        self._event.set()

    def end(self, ending: _Ending) -> None:
        self._ended, self._ending = True, ending
        self._event.set()

    async def next(self) -> Optional[RequestOutput]:
        """What arrived since the last call (a DELTA output), waiting for it; None once the
        stream is over (after the finished output, or ended without one: aborted). Raises
        RequestFailed or EngineDeadError when the request failed."""
        while True:
            if self._pending is not None:
                out, self._pending = self._pending.output(), None
                self._delivered_last = out.finished
                return out
            if self._ended or self._delivered_last:
                if isinstance(self._ending, RequestError):
                    raise RequestFailed(self._ending)
                if isinstance(self._ending, EngineDeadError):
                    raise self._ending
                return None
            self._event.clear()
            await self._event.wait()


class EngineCoreClient:
    """Starts and drives the engine-core process. ``on_step(StepOutputs, outputs, now)`` sees
    every step message with the RequestOutputs made of it (metrics); ``on_dead(reason)`` runs
    once if the process dies."""

    def __init__(self, args: EngineArgs,
                 on_step: Optional[Callable[[StepOutputs, list[RequestOutput], float], None]] = None,
                 on_dead: Optional[Callable[[str], None]] = None, cpu_ids: Optional[list[int]] = None,
                 ray_cpus: Optional[int] = None):
        self.args = args
        self.cpu_ids = cpu_ids  # the cores the engine-core process may use (None: all)
        self.ray_cpus = ray_cpus  # not None: run the engine core as a Ray actor of that many CPUs
        self.on_step = on_step
        self.on_dead = on_dead
        self.info: Optional[CoreReady] = None
        self.tokenizer: Any = None  # loaded here (the core process has none); None for a model without one
        self.processor: Optional[OutputProcessor] = None  # the front end's text, once the core is ready
        self.stats = None  # the latest EngineStats
        self.dead_reason: Optional[str] = None
        self.last_message = time.monotonic()
        self._streams: dict[str, RequestStream] = {}
        self._replies: dict[str, asyncio.Future] = {}  # LoRA commands awaiting the core's answer
        self._tasks: list[asyncio.Task] = []

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if getattr(self, "_proc", None) else None

    async def start(self, timeout_s: float = 1800.0) -> CoreReady:
        """Spawns the process and waits for its CoreReady; ValueError if it cannot start."""
        import zmq
        import zmq.asyncio

        self._ctx, self._actx = zmq.Context(), zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._pull = self._actx.socket(zmq.PULL)
        if self.ray_cpus is None:
            self._dir = tempfile.mkdtemp(prefix="vpage-core-")
            os.chmod(self._dir, 0o700)
            inp, out = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
            self._push.bind(inp)
            self._pull.bind(out)
        else:  # an actor may run on another node: tcp ports on this node's address
            host = await asyncio.get_running_loop().run_in_executor(None, RayCore.node_address)
            inp = f"tcp://{host}:{self._push.bind_to_random_port(f'tcp://{host}')}"
            out = f"tcp://{host}:{self._pull.bind_to_random_port(f'tcp://{host}')}"
        self._push_monitor = self._push.get_monitor_socket(zmq.EVENT_ACCEPTED)
        self._proc = (LocalCore(self.args, inp, out, self.cpu_ids) if self.ray_cpus is None else
                      await asyncio.get_running_loop().run_in_executor(
                          None, lambda: RayCore(self.args, inp, out, self.ray_cpus)))
        deadline = time.monotonic() + timeout_s
        while True:
            if await self._pull.poll(int(_WATCH_S * 1000)):
                msg = decode(await self._pull.recv())
                if isinstance(msg, CoreFailed):
                    await self.shutdown()
                    raise ValueError(msg.message)
                if isinstance(msg, CoreReady):
                    self.info = msg
                    self.tokenizer = load_tokenizer(self.args.model)  # the model's files are sound now
                    self.processor = OutputProcessor(self.tokenizer)
                    self._remove_endpoints()
                    break
            if not self._proc.is_alive() or time.monotonic() > deadline:
                how = self._proc.exit_description()
                await self.shutdown()
                raise ValueError(f"the engine-core process did not start ({how})")
        self.last_message = time.monotonic()
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._watch())]
        return msg

    def _remove_endpoints(self) -> None:
        """Removes the sockets' directory once the engine core is connected to both (the
        output socket carried CoreReady; the input one reports the accepted connection): ipc
        paths only serve new connections, so none is left behind even if this process is
        killed. Without the event the directory stays until shutdown."""
        from zmq.utils.monitor import recv_monitor_message

        if self._push_monitor.poll(int(_WATCH_S * 1000)):
            recv_monitor_message(self._push_monitor)
            shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)
        self._push.disable_monitor()
        self._push_monitor.close(linger=0)

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: Optional[str] = None, lora_request: Optional[LoRARequest] = None) -> RequestStream:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if params.output_kind != RequestOutputKind.DELTA:
            raise ValueError("the engine core streams DELTA outputs: ask SamplingParams(output_kind=DELTA)")
        arrival = time.monotonic()
        stream = RequestStream(request_id, prompt_token_ids)
        self._streams[request_id] = stream
        self.processor.add(RequestState(request_id, None, prompt_token_ids, params, self.tokenizer, arrival))
        self._push.send(encode(EngineCoreRequest(request_id, prompt_token_ids, params, arrival, cache_salt,
                                                 lora_request=lora_request)))
        return stream

    async def lora_command(self, add: Optional[LoRARequest] = None, remove: Optional[int] = None) -> CommandReply:
        """Loads (``add``) or forgets (``remove``) a LoRA adapter in the engine core and waits for
        its answer."""
        return await self._command(lambda reply_id: LoraCommand(reply_id, add, remove))

    async def reset_prefix_cache(self) -> CommandReply:
        """Empties the engine's prefix cache; the reply's error says why not (409: requests hold
        KV blocks)."""
        return await self._command(ResetPrefixCache)

    async def _command(self, make: Callable[[str], Any]) -> CommandReply:
        """Sends the command ``make(reply_id)`` to the engine core and waits for its reply."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        reply_id = f"cmd-{uuid.uuid4().hex}"
        future = asyncio.get_running_loop().create_future()
        self._replies[reply_id] = future
        self._push.send(encode(make(reply_id)))
        try:
            return await future
        finally:
            self._replies.pop(reply_id, None)

    def abort(self, request_ids: list[str]) -> None:
        """Aborts unfinished requests (their blocks are freed) and ends their streams."""
        ids = [rid for rid in request_ids if rid in self._streams]
        if not ids:
            return
        for rid in ids:
            self._streams.pop(rid).end(None)
            self.processor.abort(rid)
        if self.dead_reason is None:
            self._push.send(encode(AbortRequests(ids)))

    def abort_all(self) -> None:
        self.abort(list(self._streams))

    def num_unfinished(self) -> int:
        return len(self._streams)

    def num_waiting_estimate(self) -> int:
        """Requests not running yet: unfinished ones minus the last step's running count."""
        running = self.stats.num_running if self.stats is not None else 0
        return max(0, len(self._streams) - running)

    def health(self, stall_s: float) -> Optional[str]:
        """None when serving; otherwise why not (dead, or no step for ``stall_s``)."""
        if self.dead_reason is not None:
            return self.dead_reason
        silent = time.monotonic() - self.last_message
        if silent > stall_s:
            return f"the engine core has not reported for {silent:.0f} s"
        return None

    # ------------------------------------------------------------------ plumbing

    async def _read_loop(self) -> None:
        try:
            while True:
                self._dispatch(decode(await self._pull.recv()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - without this loop no request can finish
            logger.exception("vpage: reading the engine core's outputs failed")
            self._die(f"lost the engine core's outputs ({type(exc).__name__})")

    def _dispatch(self, msg: StepOutputs) -> None:
        now = self.last_message = time.monotonic()
        if msg.stats is not None:
            self.stats = msg.stats
        outputs, stopped = self.processor.process(msg.outputs)
        if stopped and self.dead_reason is None:
            self._push.send(encode(FinishSequences(stopped)))
        for delta in outputs:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                if delta.finished:
                    del self._streams[delta.request_id]
                stream.put(delta)
        for reply in msg.replies:
            future = self._replies.get(reply.reply_id)
            if future is not None and not future.done():
                future.set_result(reply)
        for error in msg.errors:
            self.processor.abort(error.request_id)
            stream = self._streams.pop(error.request_id, None)
            if stream is not None:
                stream.end(error)
        if self.on_step is not None:
            try:
                self.on_step(msg, outputs, now)
            except Exception:  # noqa: BLE001 - a metrics bug must not stop serving
                logger.exception("vpage: on_step failed")

    async def _watch(self) -> None:
        while self._proc.is_alive():
            await asyncio.sleep(_WATCH_S)
        self._die(f"the engine-core process exited ({self._proc.exit_description()})")

    def _die(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        if self.args.data_parallel_rank is not None:
            reason = f"data-parallel replica {self.args.data_parallel_rank}: {reason}"
        logger.error("vpage: %s", reason)
        self.dead_reason = reason
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.end(EngineDeadError(reason))
        for future in self._replies.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead(reason)

    async def shutdown(self) -> None:
        """Aborts everything, kills the process (it keeps no state worth saving) and cleans up."""
        for task in self._tasks:
            task.cancel()
        self.dead_reason = self.dead_reason or "the server is shutting down"
        for stream in list(self._streams.values()):
            stream.end(None)
        self._streams = {}
        proc = getattr(self, "_proc", None)
        if proc is not None:
            proc.kill()
            await asyncio.get_running_loop().run_in_executor(None, proc.join, 10)
        for sock in (getattr(self, "_push_monitor", None), getattr(self, "_push", None), getattr(self, "_pull", None)):
            if sock is not None:
                sock.close(linger=0)
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)
