"""Completions and chat completions: validated requests to engine requests, and engine
outputs back to OpenAI answers or server-sent events.

Everything the engine could refuse is checked here first (model name, vocabulary, context
length, ``n``/``best_of`` against ``max_num_seqs``, parameter combinations), so a request
reaches the engine core only when it can be served. Requests end early, aborted in the
engine, when the client disconnects, when the per-request timeout passes, or when the
server drains on shutdown; streams then end with ``finish_reason: "abort"`` and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Union

from vpage.engine.core_client import EngineCoreClient, EngineDeadError, RequestFailed, RequestStream
from vpage.entrypoints.openai import prompt_logprobs
from vpage.entrypoints.openai.chat_utils import ChatOptions, ChatServing, PreparedChat
from vpage.entrypoints.openai.lora_adapters import ServedAdapters
from vpage.entrypoints.openai.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from vpage.entrypoints.openai.responses import ResponseBuilder
from vpage.entrypoints.openai.server_metrics import ServerMetrics
from vpage.entrypoints.openai.structured_outputs import structured_outputs_params
from vpage.entrypoints.openai.token_controls import check_bad_words, token_control_kwargs
from vpage.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from vpage.sampling_params import RequestOutputKind, SamplingParams

AnyRequest = Union[CompletionRequest, ChatCompletionRequest]
_SAMPLING_FIELDS = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
                    "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "use_beam_search",
                    "length_penalty", "early_stopping")


@dataclass
class ServingLimits:
    max_waiting_requests: Optional[int] = None  # load shedding: 503 past this many waiting
    request_timeout_s: Optional[float] = None  # abort a request that runs longer


@dataclass
class Submission:
    """An admitted API request: its response builder and one engine stream per prompt."""

    builder: ResponseBuilder
    streams: list[RequestStream]
    include_usage: bool


class ServedModel:
    """What every server has of its model, whatever it runs: the engine's client (``info``,
    health), the served name and card, the metrics, and whether it drains."""

    def __init__(self, client: Any, model_name: str, metrics: Any):
        self.client = client
        self.model_name = model_name
        self.metrics = metrics
        self.draining = False
        self.created = int(time.time())
        self.adapters = ServedAdapters(model_name)  # LoRA adapters, served by name

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "vpage",
                "max_model_len": self.client.info.max_model_len}

    def models(self) -> dict:
        return {"object": "list",
                "data": [self.model_card(), *self.adapters.cards(self.created, self.client.info.max_model_len)]}

    def card_of(self, model_id: str) -> Optional[dict]:
        """The ``/v1/models/{id}`` card of the base model or an adapter, or None."""
        return next((card for card in self.models()["data"] if card["id"] == model_id), None)


class OpenAIServing(ServedModel):
    def __init__(self, client: EngineCoreClient, model_name: str, metrics: ServerMetrics,
                 limits: ServingLimits, chat: Optional[ChatOptions] = None):
        super().__init__(client, model_name, metrics)
        self.chat = ChatServing(chat or ChatOptions())  # templates, tools, reasoning
        self.limits = limits

    # ------------------------------------------------------------------ admission

    def submit(self, req: AnyRequest, cache_salt: Optional[str]) -> Submission:
        """Validates ``req`` and queues its engine requests (all or none)."""
        if self.draining:
            raise ApiError(503, "the server is shutting down", kind="service_unavailable")
        if self.client.dead_reason is not None:
            raise ApiError(503, "the engine is not available", kind="service_unavailable")
        lora = self.adapters.resolve(req.model)
        unsupported = req.unsupported()
        if unsupported:
            raise ApiError(400, f"'{unsupported}' is not supported by vpage", param=unsupported)
        limit = self.limits.max_waiting_requests
        if limit is not None and self.client.num_waiting_estimate() >= limit:
            raise ApiError(503, f"the server is overloaded ({limit} requests waiting); retry later",
                           kind="service_unavailable", headers={"Retry-After": "1"})
        chat = isinstance(req, ChatCompletionRequest)
        prompt_logprobs.check_request(req, chat)
        prepared = self.chat.prepare(self._tokenizer(), req) if chat else None
        prompts = [prepared.prompt_token_ids] if chat else [self._prompt_ids(p) for p in req.prompt_list()]
        params = [self._params(req, len(ids), chat, prepared) for ids in prompts]
        echo = None
        if not chat and req.echo:
            echo = prompt_logprobs.PromptEcho(self._tokenizer(), prompts, req.logprobs,
                                              prompt_logprobs.scores_only(req, chat))
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        options = req.stream_options
        continuous = bool(req.stream and options and options.include_usage and options.continuous_usage_stats)
        builder = ResponseBuilder(request_id, lora.lora_name if lora else self.model_name, chat, req.n, echo,
                                  [len(ids) for ids in prompts] if continuous else None,
                                  prepared and prepared.output)
        streams: list[RequestStream] = []
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                self.metrics.on_prompt(f"{request_id}-{i}", len(ids), bool(req.stream))
                streams.append(self.client.add_request(f"{request_id}-{i}", ids, p, cache_salt, lora))
        except EngineDeadError as exc:
            self.abort(streams)
            raise engine_unavailable(exc) from None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Submission(builder, streams, include_usage)

    def prompt_tokens(self, req: ChatCompletionRequest) -> int:
        """How many tokens the prompt of chat request ``req`` has (its template applied)."""
        self.adapters.resolve(req.model)
        return len(self.chat.prepare(self._tokenizer(), req).prompt_token_ids)

    def _tokenizer(self):
        tokenizer = self.client.tokenizer
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; send prompt token ids", param="prompt")
        return tokenizer

    def _prompt_ids(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            return list(self._tokenizer().encode(prompt))
        vocab = self.client.info.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"prompt token ids out of range [0, {vocab}): {bad[:5]}", param="prompt")
        return list(prompt)

    def _params(self, req: AnyRequest, prompt_len: int, chat: bool,
                prepared: Optional[PreparedChat] = None) -> SamplingParams:
        info = self.client.info
        if prompt_len == 0:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if prompt_len > info.max_prompt_tokens:
            raise ApiError(400, f"this model's maximum context length is {info.max_model_len} tokens; the prompt "
                                f"has {prompt_len} tokens and leaves no room to generate",
                           param="messages" if chat else "prompt")
        defaults = dict(info.generation_defaults)  # the model's, for the fields the request leaves unset
        max_tokens = req.max_completion_tokens if chat else None
        max_tokens = max_tokens or req.max_tokens
        if max_tokens is not None and prompt_len + max_tokens > info.max_model_len:
            raise ApiError(400, f"this model's maximum context length is {info.max_model_len} tokens; the request "
                                f"has {prompt_len} prompt tokens and asks for {max_tokens} more", param="max_tokens")
        if max_tokens is None:  # the model's default, or 16 for completions, within the context left
            default = defaults.get("max_tokens", None if chat else 16)
            max_tokens = None if default is None else min(default, info.max_model_len - prompt_len)
        defaults.pop("max_tokens", None)
        if prompt_logprobs.scores_only(req, chat):
            max_tokens = 1  # generated, not reported
        kwargs = {**defaults,
                  **{name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}}
        if kwargs.get("top_k", 0) >= info.vocab_size:
            kwargs["top_k"] = -1  # every token: the same as no top-k
        if chat and req.logprobs:
            kwargs["logprobs"] = req.top_logprobs or 0
        elif not chat and req.logprobs is not None:
            kwargs["logprobs"] = req.logprobs
        kwargs.update(token_control_kwargs(req, info.vocab_size))
        if (k := prompt_logprobs.engine_prompt_logprobs(req, chat)) is not None:
            kwargs["prompt_logprobs"] = k
        try:
            kwargs["structured_outputs"] = structured_outputs_params(req)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=getattr(exc, "param", "structured_outputs")) from None
        if prepared is not None:  # a tool_choice constraint; special tokens the tool parser reads
            prepared.update_sampling(kwargs)
        try:
            params = SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA, **kwargs)
        except (TypeError, ValueError) as exc:
            raise ApiError(400, str(exc)) from None
        check_bad_words(params, self.client.tokenizer, info.vocab_size)
        if params.best_of > info.max_num_seqs:
            name = "best_of" if req.best_of is not None else "n"
            raise ApiError(400, f"{name} is {params.best_of}; this server runs at most {info.max_num_seqs} "
                                "sequences at once (--max-num-seqs)", param=name)
        if req.stream and (params.best_of != params.n or params.use_beam_search):
            # Streamed text must only grow: hidden samples and beams that swap places cannot be streamed.
            raise ApiError(400, "streaming needs best_of equal to n and no beam search", param="best_of")
        return params

    def abort(self, streams: list[RequestStream]) -> None:
        unfinished = [s.request_id for s in streams if not s.finished]
        for rid in unfinished:
            self.metrics.forget(rid)
        self.client.abort(unfinished)

    # ------------------------------------------------------------------ answers

    async def respond(self, sub: Submission, disconnected: Callable[[], Awaitable[None]]) -> dict:
        """The whole answer. Aborts the request when ``disconnected()`` returns (the client
        left) or the timeout passes (504)."""
        work = asyncio.ensure_future(self._finals(sub.streams, sub.builder.n))
        watch = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({work, watch}, timeout=self.limits.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if work not in done:
            work.cancel()
            self.abort(sub.streams)
            if watch in done:
                raise ApiError(499, "the client disconnected")
            raise ApiError(504, f"the request did not finish within {self.limits.request_timeout_s} s",
                           kind="timeout_error")
        return sub.builder.response(work.result())

    async def _finals(self, streams: list[RequestStream], n: int) -> list[RequestOutput]:
        finals = []
        try:
            for stream in streams:
                total = OutputAccumulator(stream.request_id, stream.prompt_token_ids)
                while (out := await stream.next()) is not None:
                    total.add(out)
                finals.append(_aborted(stream, None if total.empty else total.output(), n))
        except RequestFailed as exc:
            self.abort(streams)
            kind = "invalid_request_error" if exc.status == 400 else "server_error"
            raise ApiError(exc.status, str(exc), kind=kind) from None
        except EngineDeadError as exc:
            raise engine_unavailable(exc) from None
        return finals

    async def stream(self, sub: Submission) -> AsyncIterator[bytes]:
        """Server-sent events: a chunk per new piece of text, an optional usage chunk, then
        ``data: [DONE]``. Prompts are streamed in order (their requests run concurrently).
        Closing the generator (client gone) aborts what is still running. A request that fails
        before its first event (the engine refused it: a grammar that does not compile) raises
        ApiError instead, so the caller can answer with its status."""
        builder = sub.builder
        started = False
        deadline = None if self.limits.request_timeout_s is None else time.monotonic() + self.limits.request_timeout_s
        try:
            for i, stream in enumerate(sub.streams):
                while True:
                    timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                    try:
                        out = await asyncio.wait_for(stream.next(), timeout)
                    except asyncio.TimeoutError:
                        self.abort(sub.streams)
                        out = None
                    if out is None:  # aborted (or timed out) before it finished
                        for chunk in builder.abort_chunks(i):
                            yield _event(chunk)
                        break
                    for chunk in builder.chunks(i, out):
                        started = True
                        yield _event(chunk)
                    if out.finished:
                        break
            if sub.include_usage:
                yield _event(builder.stream_usage_chunk([len(s.prompt_token_ids) for s in sub.streams]))
        except RequestFailed as exc:
            kind = "invalid_request_error" if exc.status == 400 else "server_error"
            if not started:
                raise ApiError(exc.status, str(exc), kind=kind) from None
            yield _event(ApiError(exc.status, str(exc), kind=kind).body())
        except EngineDeadError as exc:
            yield _event(engine_unavailable(exc).body())
        finally:
            self.abort(sub.streams)
        yield b"data: [DONE]\n\n"


def engine_unavailable(exc: EngineDeadError) -> ApiError:
    """503 for a request whose engine died (with data parallelism: its replica), saying why."""
    return ApiError(503, f"the engine is not available: {exc}", kind="service_unavailable")


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def chat_chunks(events: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """The chunks of ``OpenAIServing.stream``'s events, parsed, up to ``[DONE]`` (what the other
    APIs on the chat pipeline translate)."""
    async for raw in events:
        data = raw.removeprefix(b"data: ").strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def _aborted(stream: RequestStream, total: Optional[RequestOutput], n: int) -> RequestOutput:
    """``total`` (what the request's deltas add up to) if it finished; otherwise it (or an empty
    output) with every one of the ``n`` sequences that did not finish marked ``abort``."""
    if total is not None and total.finished:
        return total
    if total is None:
        total = RequestOutput(stream.request_id, None, stream.prompt_token_ids, [], False)
    present = {c.index for c in total.outputs}
    total.outputs += [CompletionOutput(i, "", [], None, None) for i in range(n) if i not in present]
    total.outputs.sort(key=lambda c: c.index)
    for c in total.outputs:
        if c.finish_reason is None:
            c.finish_reason = "abort"
    total.finished = True
    return total
