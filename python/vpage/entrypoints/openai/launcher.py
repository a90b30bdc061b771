"""Runs the API server: starts the engine-core process (one per replica with data parallelism),
then uvicorn, until a signal.

SIGTERM or SIGINT starts a drain: the listening socket closes, /health turns 503, running
requests may finish for ``drain_timeout_s``, then whatever is left is aborted (streams end
with ``finish_reason: "abort"`` and ``[DONE]``) and the process exits 0. A second SIGINT
skips the wait. If the engine-core process dies (with data parallelism: the last replica),
requests get 503 and the process exits 1.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Optional, Union

import uvicorn

from vpage.engine.arg_utils import EngineArgs
from vpage.engine.core_client import EngineCoreClient
from vpage.engine.dp_client import DPEngineCoreClient
from vpage.entrypoints.openai.api_server import HttpLimits, build_app
from vpage.entrypoints.openai.auth import ApiKeys
from vpage.entrypoints.openai.cors import CorsOptions
from vpage.entrypoints.openai.chat_utils import ChatOptions
from vpage.entrypoints.openai.http_protocol import json_error_protocol
from vpage.entrypoints.openai.protocol import ApiError
from vpage.entrypoints.openai.server_metrics import ServerMetrics
from vpage.entrypoints.openai.serving import OpenAIServing, ServingLimits
from vpage.entrypoints.pooling.client import PoolingClient
from vpage.entrypoints.pooling.metrics import PoolingMetrics
from vpage.entrypoints.pooling.serving import PoolingServing
from vpage.pooling import make_pooling_engine, resolve_runner
from vpage.entrypoints.responses.store import ResponseStore

logger = logging.getLogger("vpage")

_DEAD_GRACE_S = 2.0  # keep answering 503 this long after the engine died, then exit 1


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "smollm2"
    keys: ApiKeys = field(default_factory=lambda: ApiKeys({}))
    serving: ServingLimits = field(default_factory=ServingLimits)
    http: HttpLimits = field(default_factory=HttpLimits)
    cors: CorsOptions = field(default_factory=CorsOptions)
    drain_timeout_s: float = 30.0
    keep_alive_s: float = 15.0  # above httpx's 5 s pool expiry (--timeout-keep-alive)
    header_timeout_s: float = 10.0  # to deliver a request's head (line and headers)
    chat: ChatOptions = field(default_factory=ChatOptions)  # chat template, tool and reasoning parsers
    max_stored_responses: int = 1024  # the Responses API's store (previous_response_id)
    lora_modules: list[tuple[str, str]] = field(default_factory=list)  # (name, path) served from the start
    data_parallel_routing: str = "prefix"  # with data_parallel_size > 1: "prefix" or "round_robin"


class _Server(uvicorn.Server):
    """uvicorn with a drain on the first signal and exit code 1 when the engine died."""

    def __init__(self, config: uvicorn.Config, serving: Union[OpenAIServing, PoolingServing], options: ServerOptions):
        super().__init__(config)
        self.serving = serving
        self.options = options
        self.exit_code = 0
        self._drain_started = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self._loop = asyncio.get_running_loop()
        if self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"vpage: serving {self.options.model_name} on http://{host}:{port}/v1 "
                  f"(engine core {_pids(self.serving.client.pid)})", flush=True)

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's signal handler: the first signal drains, a second one stops at once.
        (Unlike uvicorn's, it does not re-raise the signal at exit, so the exit code is 0.)"""
        if self._loop is None:  # start-up not finished
            self.should_exit = True
        elif not self._drain_started:
            self._drain_started = True
            self._loop.call_soon_threadsafe(self._loop.create_task, self.drain())
        else:
            self._loop.call_soon_threadsafe(self.serving.client.abort_all)
            self.should_exit = True

    async def drain(self) -> None:
        logger.warning("vpage: draining (%d requests running)", self.serving.client.num_unfinished())
        self.serving.draining = True
        for server in self.servers:
            server.close()  # stop accepting connections
        client = self.serving.client
        deadline = self._loop.time() + self.options.drain_timeout_s
        while client.num_unfinished() and self._loop.time() < deadline:
            await asyncio.sleep(0.05)
        client.abort_all()
        await asyncio.sleep(0.2)  # let the aborted streams write their last chunk and [DONE]
        self.should_exit = True

    def engine_died(self, reason: str) -> None:
        self.exit_code = 1
        self.serving.draining = True
        asyncio.get_running_loop().call_later(_DEAD_GRACE_S, setattr, self, "should_exit", True)


def _pids(pid) -> str:
    """"pid N", or "pids N, M" for the replicas of a data-parallel server."""
    return f"pid {pid}" if not isinstance(pid, list) else "pids " + ", ".join(str(p) for p in pid)


async def _start_generation(args: EngineArgs, options: ServerOptions) -> OpenAIServing:
    metrics = ServerMetrics(options.model_name, args.data_parallel_size)
    client: Union[EngineCoreClient, DPEngineCoreClient] = (
        EngineCoreClient(args, on_step=metrics.on_step) if args.data_parallel_size == 1
        else DPEngineCoreClient(args, on_step=metrics.on_step, routing=options.data_parallel_routing))
    await client.start()
    serving = OpenAIServing(client, options.model_name, metrics, options.serving, options.chat)
    try:
        for name, path in options.lora_modules:
            await serving.adapters.load(client, name, path)
    except ApiError as e:
        await client.shutdown()
        raise ValueError(f"--lora-modules {name}={path}: {e}") from None
    return serving


async def _start_pooling(args: EngineArgs, options: ServerOptions) -> PoolingServing:
    """The pooling engine, loaded off the event loop, on its own thread in this process."""
    engine = await asyncio.get_running_loop().run_in_executor(None, make_pooling_engine, args)
    metrics = PoolingMetrics(options.model_name)
    return PoolingServing(PoolingClient(engine, on_step=metrics.on_step), options.model_name, metrics)


async def serve(args: EngineArgs, options: ServerOptions) -> int:
    """Serves until a signal (exit code 0) or the engine's death (1): a generation model through
    an engine-core process, a pooling model (``--runner pooling``, or an encoder architecture)
    through a pooling engine. ValueError when the engine cannot start or the port is taken."""
    pooling = resolve_runner(args.model, args.runner) == "pooling"
    if pooling and args.data_parallel_size > 1:
        raise ValueError("--data-parallel-size applies to generation; this model runs the pooling runner")
    serving = await (_start_pooling if pooling else _start_generation)(args, options)
    client = serving.client
    app = build_app(serving, options.keys, options.http, options.cors, ResponseStore(options.max_stored_responses))
    config = uvicorn.Config(app, host=options.host, port=options.port, loop="asyncio", lifespan="off",
                            http=json_error_protocol(options.header_timeout_s), backlog=2048,
                            timeout_keep_alive=int(options.keep_alive_s), timeout_graceful_shutdown=5,
                            h11_max_incomplete_event_size=16 << 10, log_level="warning", access_log=False)
    server = _Server(config, serving, options)
    client.on_dead = server.engine_died
    try:
        await server.serve()
        if not server.started and server.exit_code == 0:
            raise ValueError(f"cannot listen on {options.host}:{options.port}")
    finally:
        await client.shutdown()
    return server.exit_code


def run(args: EngineArgs, options: ServerOptions) -> int:
    return asyncio.run(serve(args, options))
