"""The ingress deployment of the Ray Serve app: vpage's own OpenAI-compatible FastAPI app (the
same routes, validation and text handling as ``vpage serve``), built in each ingress replica
over a :class:`ServeEngineClient`, which sends every request to the engine deployment through
its handle (the prefix-aware router picks the replica) and streams the outputs back."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

from vpage.engine.arg_utils import EngineArgs
from vpage.engine.core_client import RequestStream
from vpage.engine.core_messages import CommandReply, CoreReady, RequestError, StepOutputs
from vpage.entrypoints.openai.api_server import build_app
from vpage.entrypoints.openai.server_metrics import ServerMetrics
from vpage.entrypoints.openai.serving import OpenAIServing
from vpage.entrypoints.responses.store import ResponseStore
from vpage.lora.request import LoRARequest
from vpage.model_executor.loader.model_loader import load_tokenizer
from vpage.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("vpage")


class ServeEngineClient:
    """What the server uses of an engine client, over the engine deployment's handle. Ray
    Serve owns the replicas' placement and health; a request that fails on its replica ends
    with that replica's error."""

    dead_reason: Optional[str] = None
    pid: Optional[int] = None

    def __init__(self, handle: Any, model: Optional[str], metrics: ServerMetrics):
        self.handle = handle
        self.model = model
        self.metrics = metrics
        self.info: Optional[CoreReady] = None
        self.tokenizer: Any = None
        self._streams: dict[str, RequestStream] = {}
        self._responses: dict[str, Any] = {}
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self.info = await self.handle.info.remote()
        self.tokenizer = load_tokenizer(self.model)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: Optional[str] = None, lora_request: Optional[LoRARequest] = None) -> RequestStream:
        if params.output_kind != RequestOutputKind.DELTA:
            raise ValueError("the engine streams DELTA outputs: ask SamplingParams(output_kind=DELTA)")
        stream = RequestStream(request_id, prompt_token_ids)
        self._streams[request_id] = stream
        self._responses[request_id] = self.handle.options(stream=True).generate.remote(
            request_id, prompt_token_ids, params, cache_salt, lora_request)
        task = asyncio.create_task(self._pump(request_id, stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return stream

    async def _pump(self, request_id: str, stream: RequestStream) -> None:
        response = self._responses[request_id]
        try:
            async for item in response:
                if isinstance(item, RequestError):
                    stream.end(item)
                    return
                stream.put(item)
                now = time.monotonic()
                self.metrics.on_step(StepOutputs(step_start=now), [item], now)
            if not stream.finished:
                stream.end(None)
        except asyncio.CancelledError:
            stream.end(None)
        except Exception as exc:  # noqa: BLE001 - the replica or the call failed: the request did
            logger.warning("vpage: request %s failed on its Ray Serve replica: %s", request_id, exc)
            stream.end(RequestError(request_id, 503, f"the engine replica failed ({type(exc).__name__})"))
        finally:
            self._streams.pop(request_id, None)
            self._responses.pop(request_id, None)

    async def lora_command(self, add: Optional[LoRARequest] = None, remove: Optional[int] = None) -> CommandReply:
        return CommandReply("", "LoRA adapters are not served under Ray Serve yet", 400)

    async def reset_prefix_cache(self) -> CommandReply:
        return CommandReply("", "under Ray Serve a request reaches one replica: reset each engine's cache "
                                "through its own server", 400)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            response = self._responses.pop(request_id, None)
            if response is not None:
                response.cancel()  # the replica's generator is cancelled and aborts the request
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.end(None)

    def abort_all(self) -> None:
        self.abort(list(self._streams))

    def num_unfinished(self) -> int:
        return len(self._streams)

    def num_waiting_estimate(self) -> int:
        return 0  # Ray Serve queues requests for busy replicas itself

    def health(self, stall_s: float) -> Optional[str]:
        return None  # Ray Serve checks the replicas and replaces unhealthy ones

    async def shutdown(self) -> None:
        self.abort_all()


class VpageIngress:
    """The body of the ingress deployment (``serve.ingress()`` in ``app.py``): the FastAPI app
    is built at replica start, once the engine deployment answers."""

    def __init__(self, engine: Any, args: EngineArgs, options: Any):
        self.engine = engine
        self.args = args
        self.options = options

    async def __serve_build_asgi_app__(self) -> Any:
        options = self.options
        metrics = ServerMetrics(options.model_name)
        client = ServeEngineClient(self.engine, self.args.model, metrics)
        await client.start()
        serving = OpenAIServing(client, options.model_name, metrics, options.serving, options.chat)
        return build_app(serving, options.keys, options.http, options.cors, ResponseStore(options.max_stored_responses))
