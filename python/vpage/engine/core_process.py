"""The engine-core process: an ``EngineCore`` in a busy loop, fed and drained over ZeroMQ.

The API process binds two sockets and starts :func:`run_engine_core` in a child process.
The child pulls :class:`EngineCoreRequest` / :class:`AbortRequests` / :class:`FinishSequences`
messages, steps the core while it has work, and pushes one :class:`StepOutputs` per step (a
heartbeat every ``HEARTBEAT_S`` when idle): the step's token ids and numbers, which the API
process turns into text (its output processor) while this process computes the next step.
Engine statistics ride along at most every ``STATS_INTERVAL_S``. It ignores SIGINT/SIGTERM
(the API process drains, then kills it) and dies with its parent, so it is never orphaned.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import Optional

import torch

from vpage import _core
from vpage.engine.arg_utils import EngineArgs
from vpage.engine.core import EngineCore
from vpage.engine.core_io import EngineCoreRequest
from vpage.engine.core_messages import (AbortRequests, CommandReply, CoreFailed, CoreReady, FinishSequences,
                                        LoraCommand, RequestError, ResetPrefixCache, StepOutputs, decode,
                                        encode)
from vpage.executor.errors import WorkerDiedError

logger = logging.getLogger("vpage")

HEARTBEAT_S = 0.5
STATS_INTERVAL_S = 0.1
_MAX_FAILED_STEPS = 8  # consecutive failed steps after which the engine is declared dead


class EngineCoreProc:
    """Owns an EngineCore: admits, aborts and ends requests, and steps it so that a failure
    fails only the requests that were live, never the engine."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.live: set[str] = set()
        self.failed_steps = 0
        self._stats_at = float("-inf")  # when stats were last computed

    def add(self, msg: EngineCoreRequest) -> Optional[RequestError]:
        """Queues a request; one the engine refuses comes back as a 400 error, one it fails
        to add (a bug) as a 500."""
        try:
            self.core.add_request(msg)
        except (ValueError, TypeError, OverflowError) as exc:
            return RequestError(msg.request_id, 400, str(exc))
        except Exception as exc:  # noqa: BLE001 - the engine's bug, not the request's; keep serving
            logger.exception("vpage: add_request failed")
            return RequestError(msg.request_id, 500, f"the engine could not add the request ({type(exc).__name__})")
        self.live.add(msg.request_id)
        return None

    def lora(self, command: LoraCommand) -> CommandReply:
        """Loads or forgets an adapter; the reply says why not when it cannot."""
        try:
            if command.add is not None:
                self.core.add_lora(command.add)
            elif not self.core.remove_lora(command.remove):
                return CommandReply(command.reply_id, f"no LoRA adapter has id {command.remove}", 404)
        except ValueError as exc:
            missing = "not a folder" in str(exc) or "no adapter_config.json" in str(exc)
            return CommandReply(command.reply_id, str(exc), 404 if missing else 400)
        return CommandReply(command.reply_id)

    def reset_prefix_cache(self, command: ResetPrefixCache) -> CommandReply:
        if self.core.reset_prefix_cache():
            return CommandReply(command.reply_id)
        return CommandReply(command.reply_id, "requests hold KV blocks: the prefix cache was not reset", 409)

    def abort(self, request_ids: list[str]) -> None:
        ids = [rid for rid in request_ids if rid in self.live]
        self.core.abort_requests(ids)
        self.live.difference_update(ids)

    def finish(self, samples: list[tuple[str, int]]) -> None:
        """Ends the samples a stop string ended (their later tokens are dropped)."""
        self.core.finish_sequences(samples)
        self.live.difference_update([rid for rid, _ in samples if rid not in self.core.requests])

    def step(self) -> StepOutputs:
        """One engine step. If it raises, the requests it was running are aborted and
        reported as 500 errors (the engine says a failed step commits nothing); waiting and
        swapped requests stay queued, and the loop goes on."""
        start = time.monotonic()
        errors: list[RequestError] = []
        try:
            outputs = self.core.step()
            self.failed_steps = 0
        except WorkerDiedError:
            raise  # the engine is gone, not the step: the loop fails everything and exits
        except Exception as exc:  # noqa: BLE001 - isolate the failure to this step's requests
            logger.exception("vpage: engine step failed; failing the %d live requests", len(self.live))
            self.failed_steps += 1
            failed = self._running_requests()
            self.core.abort_requests(failed)
            self.live.difference_update(failed)
            message = f"the engine step failed ({type(exc).__name__}); the request was aborted"
            errors = [RequestError(rid, 500, message) for rid in failed]
            outputs = []
        for request_id, message in self.core.take_request_errors():  # e.g. a grammar that did not compile
            errors.append(RequestError(request_id, 400, message))
            self.live.discard(request_id)
        finished = False
        for out in outputs:
            if out.finished:
                finished = True
                self.live.discard(out.request_id)
        step_tokens = self.core.metrics.last_step_tokens if outputs else 0
        # Fresh statistics when a request ends or the engine goes idle, so counters that a
        # client reads right after its answer are complete.
        stats = self.stats(force=finished or errors or not self.core.has_unfinished_requests())
        return StepOutputs(outputs, errors, stats, start, step_tokens, kv_events=self.core.take_reported_kv_events())

    def stats(self, force: bool = False):
        """The engine's statistics when ``STATS_INTERVAL_S`` has passed since the last ones
        (or ``force``), else None: they are computed on a timer, not every step."""
        now = time.monotonic()
        if not force and now - self._stats_at < STATS_INTERVAL_S:
            return None
        self._stats_at = now
        return self.core.get_stats()


    def _running_requests(self) -> list[str]:
        """The live requests with a RUNNING sequence: the ones a failed step was running.
        All live requests when that cannot be told (none running, or the scheduler's view
        is unavailable), so a step that keeps failing cannot keep the loop spinning."""
        try:
            running = []
            for rid in sorted(self.live):
                group = self.core.scheduler.find_group(rid)
                if group is None or any(group.seq(i).status == _core.SequenceStatus.RUNNING
                                        for i in range(group.num_seqs)):
                    running.append(rid)
        except Exception:  # noqa: BLE001 - the scheduler's state after a failure is unknown
            return sorted(self.live)
        return running or sorted(self.live)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (no orphans)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the parent-pid check in the loop does it


def build_engine_core(args: EngineArgs) -> EngineCore:
    """The engine core of the process: the API process handles the text, so no tokenizer is
    loaded here unless a grammar needs the vocabulary."""
    config = args.create_engine_config()
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, skip_tokenizer_init=True))
    torch.manual_seed(args.seed)
    return EngineCore(config)


def run_engine_core(args: EngineArgs, input_address: str, output_address: str, parent_pid: Optional[int],
                    cpu_ids: Optional[list[int]] = None) -> None:
    """Process entry point: builds the engine, reports CoreReady (or CoreFailed) and serves
    until the parent goes away or kills it (``parent_pid`` None: a Ray actor, which Ray stops
    with its owner). ``cpu_ids``: the cores this process (and the threads it starts) may run on
    (a data-parallel replica's share); None: all."""
    import zmq

    if parent_pid is not None:
        _die_with_parent()
    if cpu_ids:
        os.sched_setaffinity(0, cpu_ids)
    # Ctrl-C and a service manager's SIGTERM reach the whole process group: they are the API
    # process's to handle (it drains, then stops this process with SIGKILL).
    if threading.current_thread() is threading.main_thread():  # not so in a (threaded) Ray actor
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(input_address)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(output_address)
    try:
        core = build_engine_core(args)
    except Exception as exc:  # noqa: BLE001 - reported to the API process, which exits
        push.send(encode(CoreFailed(f"{type(exc).__name__}: {exc}")))
        push.close(linger=2000)
        sys.exit(1)
    config = core.config
    push.send(encode(CoreReady(core.max_model_len, core.max_model_len - 1,
                               core.model_config.vocab_size, config.scheduler.max_num_seqs,
                               config.model.generation_defaults)))
    _busy_loop(EngineCoreProc(core), pull, push, parent_pid)


def _busy_loop(proc: EngineCoreProc, pull, push, parent_pid: Optional[int]) -> None:
    try:
        _serve(proc, pull, push, parent_pid)
    except WorkerDiedError as exc:
        # A dead tensor-parallel worker cannot be replaced in place: fail every live request
        # with 503 and exit non-zero; the API process then answers 503 and exits for its
        # supervisor to restart the server.
        logger.error("vpage: %s", exc)
        message = "the engine lost a tensor-parallel worker; the server is restarting"
        push.send(encode(StepOutputs(errors=[RequestError(rid, 503, message) for rid in sorted(proc.live)],
                                     stats=proc.stats(force=True), step_start=time.monotonic())))
        push.close(linger=2000)
        sys.exit(1)


def _serve(proc: EngineCoreProc, pull, push, parent_pid: Optional[int]) -> None:
    import zmq

    last_sent = time.monotonic()
    while (parent_pid is None or os.getppid() == parent_pid) and proc.failed_steps < _MAX_FAILED_STEPS:
        errors: list[RequestError] = []
        replies: list[CommandReply] = []
        if pull.poll(0 if proc.core.has_unfinished_requests() else int(HEARTBEAT_S * 1000)):
            while True:
                try:
                    msg = decode(pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, EngineCoreRequest):
                    error = proc.add(msg)
                    if error is not None:
                        errors.append(error)
                elif isinstance(msg, AbortRequests):
                    proc.abort(msg.request_ids)
                elif isinstance(msg, FinishSequences):
                    proc.finish(msg.samples)
                elif isinstance(msg, LoraCommand):
                    replies.append(proc.lora(msg))
                elif isinstance(msg, ResetPrefixCache):
                    replies.append(proc.reset_prefix_cache(msg))
        if proc.core.has_unfinished_requests():
            out = proc.step()
            out.errors = errors + out.errors
        elif errors or replies or time.monotonic() - last_sent >= HEARTBEAT_S:
            proc.core.executor.check_health()  # idle: a dead worker must still take the server down
            out = StepOutputs(errors=errors, stats=proc.stats(force=True), step_start=time.monotonic(),
                              kv_events=proc.core.take_reported_kv_events())
        else:
            continue
        out.replies = replies
        push.send(encode(out))
        last_sent = time.monotonic()
    logger.error("vpage: engine core stopping (parent gone or %d failed steps)", proc.failed_steps)
    sys.exit(1)
