"""An OpenAI-compatible HTTP server on the standard library: /v1/models, /v1/completions,
/v1/chat/completions (with ``stream`` as server-sent events) and /health.

Each HTTP request runs on its own thread and submits engine requests to one shared
:class:`EngineLoop`, so concurrent API requests are batched together by the scheduler.
A client that disconnects while streaming has its requests aborted (blocks freed).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterable, Optional

from vpage.engine.engine_loop import EngineDeadError, EngineLoop, RequestStream
from vpage.entrypoints.openai.protocol import (ApiError, ResponseBuilder, chat_prompt, completion_prompts,
                                              parse_json, sampling_params)
from vpage.outputs import RequestOutput

logger = logging.getLogger("vpage")

_MAX_BODY_BYTES = 16 << 20


class OpenAIServer(ThreadingHTTPServer):
    """Serves ``loop``'s engine under the name ``model_name``. ``serve_forever()`` runs it;
    ``shutdown()`` then ``server_close()`` stop it (the loop is the caller's to shut down)."""

    daemon_threads = True

    def __init__(self, loop: EngineLoop, model_name: str, host: str = "127.0.0.1", port: int = 8000):
        self.loop = loop
        self.model_name = model_name
        self.created = int(time.time())
        super().__init__((host, port), _Handler)

    # ------------------------------------------------------------- endpoints

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "vpage", "max_model_len": self.loop.engine.max_model_len}]}

    def submit(self, body: dict, chat: bool) -> tuple[ResponseBuilder, list[RequestStream]]:
        """Validates an API request and queues its engine requests (all or none)."""
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                           kind="not_found_error", param="model")
        engine = self.loop.engine
        if engine.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        prompts = [chat_prompt(body, engine.tokenizer)] if chat else completion_prompts(body, engine.tokenizer)
        params = [sampling_params(body, len(p), engine.max_model_len, chat=chat) for p in prompts]
        echo = None
        if not chat and body.get("echo"):
            echo = [engine.tokenizer.decode(p) for p in prompts]
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        builder = ResponseBuilder(request_id, self.model_name, chat, params[0].n, echo)
        streams: list[RequestStream] = []
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                streams.append(self.loop.add_request(f"{request_id}-{i}", ids, p))
        except ValueError as exc:
            self.abort(streams)
            raise ApiError(400, str(exc)) from None
        except EngineDeadError as exc:
            self.abort(streams)
            raise ApiError(503, str(exc), kind="service_unavailable") from None
        return builder, streams

    def abort(self, streams: Iterable[RequestStream]) -> None:
        for stream in streams:
            self.loop.abort(stream.request_id)


class _Handler(BaseHTTPRequestHandler):
    server: OpenAIServer  # HTTP/1.0: one request per connection

    def log_message(self, fmt: str, *args) -> None:
        logger.info("vpage server: %s - %s", self.address_string(), fmt % args)

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, error: ApiError) -> None:
        self._send_json(error.status, error.body())

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            self._send_json(200, {"status": "ok", "unfinished_requests": self.server.loop.num_unfinished_requests()})
        elif self.path == "/v1/models":
            self._send_json(200, self.server.models())
        else:
            self._send_error(ApiError(404, f"no route GET {self.path}", kind="not_found_error"))

    def do_POST(self) -> None:  # noqa: N802
        routes = {"/v1/completions": False, "/v1/chat/completions": True}
        if self.path not in routes:
            self._send_error(ApiError(404, f"no route POST {self.path}", kind="not_found_error"))
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= _MAX_BODY_BYTES:
                raise ApiError(400 if length <= 0 else 413, "a JSON body with a Content-Length is required"
                               if length <= 0 else f"the body exceeds {_MAX_BODY_BYTES} bytes")
            body = parse_json(self.rfile.read(length))
            builder, streams = self.server.submit(body, chat=routes[self.path])
        except ApiError as error:
            self._send_error(error)
            return
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._stream(builder, streams, include_usage)
        else:
            self._respond(builder, streams)

    def _respond(self, builder: ResponseBuilder, streams: list[RequestStream]) -> None:
        try:
            finals = [_last(stream) for stream in streams]
        except EngineDeadError as exc:
            self._send_error(ApiError(503, str(exc), kind="service_unavailable"))
            return
        if any(out is None for out in finals):
            self._send_error(ApiError(503, "the request was aborted", kind="service_unavailable"))
            return
        self._send_json(200, builder.response(finals))

    def _stream(self, builder: ResponseBuilder, streams: list[RequestStream], include_usage: bool) -> None:
        """Server-sent events: one chunk per new piece of text, then `data: [DONE]`. The
        prompts' streams are drained in order (their requests run concurrently)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        finals: list[Optional[RequestOutput]] = []
        try:
            for i, stream in enumerate(streams):
                last = None
                for out in stream:
                    last = out
                    for chunk in builder.chunks(i, out):
                        self._event(chunk)
                finals.append(last)
            if include_usage and all(out is not None for out in finals):
                self._event(builder.usage_chunk(finals))
        except EngineDeadError as exc:
            self._event(ApiError(503, str(exc), kind="service_unavailable").body())
        except (BrokenPipeError, ConnectionResetError):
            logger.info("vpage server: client left %s; aborting it", builder.id)
            self.server.abort(streams)
            return
        try:
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _event(self, body: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        self.wfile.flush()


def _last(stream: RequestStream) -> Optional[RequestOutput]:
    last = None
    for out in stream:
        last = out
    return last if last is not None and last.finished else None


def serve(loop: EngineLoop, model_name: str, host: str, port: int) -> None:
    """Runs the server until Ctrl-C, then stops the engine loop."""
    server = OpenAIServer(loop, model_name, host, port)
    host_name, bound_port = server.server_address[:2]
    print(f"vpage: serving {model_name} on http://{host_name}:{bound_port}/v1 (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        loop.shutdown()
