"""The OpenAI-compatible HTTP API on FastAPI: routes, body limits, API keys and errors.

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` as server-sent events), ``POST /v1/responses``
with ``GET``/``DELETE /v1/responses/{id}`` (OpenAI's Responses API), ``POST /v1/messages`` and
``/v1/messages/count_tokens`` (Anthropic's Messages API); for a pooling model instead
``POST /v1/embeddings``, ``/pooling``, ``/classify``, ``/score`` and ``/rerank`` (also ``/v1/rerank``,
``/v2/rerank``); ``POST /tokenize`` and ``POST /detokenize`` (vLLM's), ``GET /health``
(milliseconds; 503 when the engine is dead, wedged, or the server is draining) and
``GET /metrics`` (Prometheus). Every error, from a bad field to an unknown route or a
wrong method, is OpenAI's JSON error body; nothing answers HTML or a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from vpage.engine.core_client import EngineDeadError
from vpage.entrypoints.anthropic.messages import chat_request, message_body, message_events
from vpage.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest, error_body
from vpage.entrypoints.openai.auth import ApiKeys, cache_salt
from vpage.entrypoints.openai.cors import CorsOptions, add_cors
from vpage.entrypoints.openai.lora_adapters import runtime_updating_allowed
from vpage.entrypoints.openai.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_body
from vpage.entrypoints.openai.serving import OpenAIServing, engine_unavailable
from vpage.entrypoints.openai.tokenization import Tokenization
from vpage.entrypoints.pooling.protocol import (ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest,
                                                ScoreRequest)
from vpage.entrypoints.pooling.serving import PoolingServing
from vpage.entrypoints.responses.protocol import ResponsesRequest
from vpage.entrypoints.responses.serving import ResponsesServing
from vpage.entrypoints.responses.store import ResponseStore

logger = logging.getLogger("vpage")


@dataclass
class HttpLimits:
    max_body_bytes: int = 16 << 20
    body_timeout_s: float = 30.0  # to receive the whole body (a Content-Length larger than it)
    max_url_bytes: int = 8192
    max_header_bytes: int = 16 << 10
    health_stall_s: float = 60.0  # /health is 503 when the engine core is silent this long


def json_response(status: int, body: dict, headers: Optional[dict] = None) -> Response:
    return Response(json.dumps(body).encode(), status_code=status, media_type="application/json", headers=headers)


def error_response(error: ApiError) -> Response:
    return json_response(error.status, error.body(), error.headers)


async def read_body(request: Request, limits: HttpLimits) -> bytes:
    """The body, at most ``max_body_bytes`` (413) and within ``body_timeout_s`` (408)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limits.max_body_bytes:
        raise ApiError(413, f"the body exceeds {limits.max_body_bytes} bytes")
    chunks, size = [], 0

    async def receive() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise ApiError(413, f"the body exceeds {limits.max_body_bytes} bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the body did not arrive within {limits.body_timeout_s} s") from None
    return b"".join(chunks)


class _HeadLimits:
    """ASGI middleware: 414 for a request target over ``max_url_bytes``, 431 for headers
    over ``max_header_bytes`` (h11 only limits a header block that arrives in pieces)."""

    def __init__(self, app, max_url_bytes: int, max_header_bytes: int):
        self.app = app
        self.max_url_bytes = max_url_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope, receive, send) -> None:
        error = None
        if scope["type"] == "http":
            url = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            headers = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
            if url > self.max_url_bytes:
                error = ApiError(414, f"the URL exceeds {self.max_url_bytes} bytes")
            elif headers > self.max_header_bytes:
                error = ApiError(431, f"the request headers exceed {self.max_header_bytes} bytes")
        if error is not None:
            await error_response(error)(scope, receive, send)
        else:
            await self.app(scope, receive, send)


async def started(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``events`` with its first event already taken: a request the engine refuses raises
    ApiError here, before any response has begun, and is answered with its status."""
    first = await events.__anext__()

    async def all_events() -> AsyncIterator[bytes]:
        yield first
        async for event in events:
            yield event

    return all_events()


def event_stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def disconnected(request: Request) -> Callable[[], Awaitable[None]]:
    """A wait that ends when the client of ``request`` goes away (a whole answer is aborted then)."""
    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


def _lora_routes(app: FastAPI, serving: OpenAIServing, limits: HttpLimits,
                 authenticate: Callable[[Request], Optional[str]]) -> None:
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``{"lora_name": ...,
    "lora_path": ...}``); plain-text success as vLLM answers."""
    async def body_of(request: Request) -> dict:
        authenticate(request)
        try:
            body = json.loads(await read_body(request, limits))
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
            raise ApiError(400, "the body must be a JSON object with a string 'lora_name'", param="lora_name")
        return body

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await body_of(request)
        path = body.get("lora_path")
        if not isinstance(path, str):
            raise ApiError(400, "'lora_path' must be a string", param="lora_path")
        await serving.adapters.load(serving.client, body["lora_name"], path)
        return Response(f"Success: LoRA adapter '{body['lora_name']}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await body_of(request)
        await serving.adapters.unload(serving.client, body["lora_name"])
        return Response(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.", media_type="text/plain")


def dev_mode() -> bool:
    """vLLM's ``VLLM_SERVER_DEV_MODE=1``: routes meant for development and benchmarks."""
    return os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip() == "1"


def _dev_routes(app: FastAPI, serving: OpenAIServing, authenticate: Callable[[Request], Optional[str]]) -> None:
    """``POST /reset_prefix_cache`` (vLLM's dev-mode route): 200 once every engine's prefix cache
    is empty, 409 while requests hold KV blocks (nothing is reset then)."""

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        authenticate(request)
        try:
            reply = await serving.client.reset_prefix_cache()
        except EngineDeadError as exc:
            raise engine_unavailable(exc) from None
        if reply.error is not None:
            raise ApiError(reply.status, reply.error, kind="conflict_error")
        return Response(status_code=200)


def _generation_routes(app: FastAPI, serving: OpenAIServing, keys: ApiKeys, limits: HttpLimits,
                       authenticate: Callable[[Request], Optional[str]],
                       responses_store: Optional[ResponseStore]) -> None:
    """Completions, chat completions, Responses and Anthropic Messages (and, when runtime LoRA
    updating is allowed, loading and unloading adapters; in dev mode, resetting the prefix cache)."""
    if runtime_updating_allowed():
        _lora_routes(app, serving, limits, authenticate)
    if dev_mode():
        _dev_routes(app, serving, authenticate)

    async def generate(request: Request, kind: type) -> Response:
        tenant = authenticate(request)
        req = parse_body(await read_body(request, limits), kind)
        sub = serving.submit(req, cache_salt(tenant, req.cache_salt))
        if req.stream:
            return event_stream(await started(serving.stream(sub)))
        return json_response(200, await serving.respond(sub, disconnected(request)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest)

    # OpenAI's Responses API on the same chat pipeline, with a store of earlier responses.
    responses = ResponsesServing(serving, responses_store if responses_store is not None else ResponseStore())

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        tenant = authenticate(request)
        req = parse_body(await read_body(request, limits), ResponsesRequest)
        turn = responses.submit(req, tenant)
        if req.stream:
            return event_stream(responses.events(turn, await started(serving.stream(turn.sub))))
        return json_response(200, await responses.respond(turn, disconnected(request)))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> Response:
        return json_response(200, responses.retrieve(authenticate(request), response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return json_response(200, responses.delete(authenticate(request), response_id))

    # Anthropic's Messages API on the same chat pipeline: its own error shape, and its
    # x-api-key header as well as Authorization.
    async def anthropic(request: Request, answer) -> Response:
        try:
            key = request.headers.get("x-api-key")
            tenant = keys.tenant(f"Bearer {key}" if key is not None else request.headers.get("authorization"))
            return await answer(tenant)
        except ApiError as exc:
            return json_response(exc.status, error_body(exc.status, exc.kind, str(exc)), exc.headers)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        async def answer(tenant: Optional[str]) -> Response:
            req = parse_body(await read_body(request, limits), MessagesRequest)
            sub = serving.submit(chat_request(req), cache_salt(tenant, None))
            if not req.stream:
                return json_response(200, message_body(await serving.respond(sub, disconnected(request)), req))
            chunks = await started(serving.stream(sub))
            message_id = "msg_" + sub.builder.id.removeprefix("chatcmpl-")
            return event_stream(message_events(chunks, req, message_id, serving.model_name,
                                               sum(len(s.prompt_token_ids) for s in sub.streams)))

        return await anthropic(request, answer)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        async def answer(tenant: Optional[str]) -> Response:
            req = parse_body(await read_body(request, limits), CountTokensRequest)
            return json_response(200, {"input_tokens": serving.prompt_tokens(chat_request(req))})

        return await anthropic(request, answer)


def _pooling_routes(app: FastAPI, serving: PoolingServing, limits: HttpLimits,
                    authenticate: Callable[[Request], Optional[str]]) -> None:
    """Embeddings (OpenAI's), vLLM's /pooling, /classify and /score, and rerank (Jina/Cohere shapes)."""
    def pooled(kind: type, answer) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            authenticate(request)
            work = asyncio.ensure_future(answer(parse_body(await read_body(request, limits), kind)))
            watch = asyncio.ensure_future(disconnected(request)())
            try:
                await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watch.cancel()
            if not work.done():  # the client left: its prompts are aborted in the engine
                work.cancel()
                raise ApiError(499, "the client disconnected")
            return json_response(200, work.result())

        return route

    for path, kind, answer in (("/v1/embeddings", EmbeddingRequest, serving.embeddings),
                               ("/pooling", PoolingRequest, serving.pooling),
                               ("/classify", ClassificationRequest, serving.classify),
                               ("/score", ScoreRequest, serving.score), ("/v1/score", ScoreRequest, serving.score),
                               ("/rerank", RerankRequest, serving.rerank), ("/v1/rerank", RerankRequest, serving.rerank),
                               ("/v2/rerank", RerankRequest, serving.rerank)):
        app.post(path)(pooled(kind, answer))


_GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                      "/v1/messages/count_tokens")
_POOLING_ROUTES = ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
                   "/v2/rerank")


def _refused_routes(app: FastAPI, paths: tuple[str, ...], message: str) -> None:
    """The other runner's routes: a 400 that says why, not a 404."""
    async def refuse(request: Request) -> Response:
        raise ApiError(400, message, param="model")

    for path in paths:
        app.post(path)(refuse)


def build_app(serving: Union[OpenAIServing, PoolingServing], keys: ApiKeys, limits: HttpLimits, cors: Optional[CorsOptions] = None,
              responses_store: Optional[ResponseStore] = None) -> FastAPI:
    app = FastAPI(title="vpage", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        headers = getattr(exc, "headers", None)
        return error_response(ApiError(exc.status_code, message, kind=kind, headers=headers))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(ApiError(400, "the request does not match the API"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("vpage: internal error on %s %s", request.method, request.url.path)
        return error_response(ApiError(500, "internal server error", kind="server_error"))

    app.add_middleware(_HeadLimits, max_url_bytes=limits.max_url_bytes, max_header_bytes=limits.max_header_bytes)
    add_cors(app, cors or CorsOptions())  # outermost: the limits' errors carry CORS headers too

    def authenticate(request: Request) -> Optional[str]:
        return keys.tenant(request.headers.get("authorization"))

    @app.get("/health")
    async def health() -> Response:
        reason = "the server is shutting down" if serving.draining else serving.client.health(limits.health_stall_s)
        if reason is not None:
            return json_response(503, {"status": "unavailable", "reason": reason})
        return json_response(200, {"status": "ok", "unfinished_requests": serving.client.num_unfinished()})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authenticate(request)
        return json_response(200, serving.models())

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        authenticate(request)
        card = serving.card_of(model_id)
        if card is None:
            raise ApiError(404, f"the model `{model_id}` does not exist", kind="not_found_error", param="model")
        return json_response(200, card)

    if isinstance(serving, PoolingServing):
        _pooling_routes(app, serving, limits, authenticate)
        _refused_routes(app, _GENERATION_ROUTES, "this model is served by the pooling runner: it embeds and scores, "
                                                 "and does not generate text")
    else:
        _generation_routes(app, serving, keys, limits, authenticate, responses_store)
        _refused_routes(app, _POOLING_ROUTES, "this model generates text; embeddings, scores and reranking need a "
                                              "pooling model (vpage serve --runner pooling)")

    tokenization = Tokenization(serving)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        authenticate(request)
        return json_response(200, tokenization.tokenize(await read_body(request, limits)))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        authenticate(request)
        return json_response(200, tokenization.detokenize(await read_body(request, limits)))

    return app
