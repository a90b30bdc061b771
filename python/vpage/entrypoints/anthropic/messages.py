"""Anthropic Messages on the chat pipeline: the request as a chat completion request, the chat
answer as an Anthropic message, and the chat's stream of chunks as Anthropic's SSE events
(``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``)."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional

from vpage.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest, error_body
from vpage.entrypoints.openai.protocol import ApiError, ChatCompletionRequest
from vpage.entrypoints.openai.serving import chat_chunks

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def _text(content: Any) -> str:
    """A system prompt or a tool result: a string, or text blocks joined."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(block.text for block in content)


def chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request that asks what ``req`` asks. ApiError(400) for what the chat
    pipeline cannot carry (images, a tool_result answering no earlier tool_use)."""
    messages: list[dict] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system)})
    called: set[str] = set()
    for m in req.messages:
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results = [], [], []
        for block in m.content:
            if block.type == "text":
                texts.append(block.text)
            elif block.type == "image":
                raise ApiError(400, "image content blocks are not supported by this model", param="messages")
            elif block.type == "tool_use":
                if m.role != "assistant":
                    raise ApiError(400, "tool_use blocks belong to assistant messages", param="messages")
                called.add(block.id)
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif block.type == "tool_result":
                if block.tool_use_id not in called:
                    raise ApiError(400, f"tool_result for unknown tool_use_id {block.tool_use_id!r}",
                                   param="messages")
                results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
        if m.role == "assistant":  # thinking blocks of earlier turns are not sent back to the model
            message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
        else:
            messages += results
            if texts:
                messages.append({"role": "user", "content": "\n".join(texts)})
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise ApiError(400, "tool_choice of type tool needs a name", param="tool_choice")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type == "enabled"}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=req.stream)
        if req.stream:
            body["stream_options"] = {"include_usage": True}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.stop_sequences:
            body["stop"] = req.stop_sequences
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as exc:
        raise ApiError(400, f"the request cannot be served: {str(exc)[:300]}") from None


def _stop(finish_reason: Optional[str], stop_reason: Any, stop_sequences: list[str]) -> tuple[str, Optional[str]]:
    """Anthropic's (stop_reason, stop_sequence) of a chat choice's finish."""
    if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def message_body(chat: dict, req: MessagesRequest) -> dict:
    """An Anthropic message made of a whole chat completion answer."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    stop_reason, stop_sequence = _stop(choice.get("finish_reason"), choice.get("stop_reason"),
                                       req.stop_sequences or [])
    usage = chat.get("usage") or {}
    return {"id": "msg_" + chat["id"].removeprefix("chatcmpl-"), "type": "message", "role": "assistant",
            "model": chat["model"], "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)}}


def _event(kind: str, body: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()


class _Blocks:
    """The content blocks of a streamed message: the open one, and the next index."""

    def __init__(self) -> None:
        self.open: Optional[tuple[str, Any]] = None  # (kind, key): ("text", None), ("tool_use", call index)
        self.index = -1

    def switch(self, kind: str, key: Any, start: dict) -> list[bytes]:
        """Events that close the open block unless it is (kind, key), then open that one."""
        if self.open == (kind, key):
            return []
        events = self.close()
        self.index += 1
        self.open = (kind, key)
        return events + [_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                        "content_block": start})]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def delta(self, delta: dict) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})


async def message_events(chunks: AsyncIterator[bytes], req: MessagesRequest, message_id: str, model: str,
                         input_tokens: int) -> AsyncIterator[bytes]:
    """Anthropic's SSE events made of the chat pipeline's stream (``data: {chunk}`` events)."""
    yield _event("message_start", {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}})
    blocks = _Blocks()
    finish: tuple[Optional[str], Any] = (None, None)
    output_tokens = 0
    async for chunk in chat_chunks(chunks):
        if "error" in chunk:
            error = chunk["error"]
            yield _event("error", error_body(error.get("code") or 500, error.get("type", "server_error"),
                                             error.get("message", "")))
            return
        if chunk.get("usage"):
            output_tokens = chunk["usage"].get("completion_tokens", output_tokens)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                for event in blocks.switch("thinking", None, {"type": "thinking", "thinking": "", "signature": ""}):
                    yield event
                yield blocks.delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                for event in blocks.switch("text", None, {"type": "text", "text": ""}):
                    yield event
                yield blocks.delta({"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                for event in blocks.switch("tool_use", call["index"], {"type": "tool_use", "id": call.get("id"),
                                                                       "name": function.get("name"), "input": {}}):
                    yield event
                if function.get("arguments"):
                    yield blocks.delta({"type": "input_json_delta", "partial_json": function["arguments"]})
            if choice.get("finish_reason") is not None:
                finish = (choice["finish_reason"], choice.get("stop_reason"))
    for event in blocks.close():
        yield event
    stop_reason, stop_sequence = _stop(finish[0], finish[1], req.stop_sequences or [])
    yield _event("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                   "usage": {"output_tokens": output_tokens}})
    yield _event("message_stop", {"type": "message_stop"})
