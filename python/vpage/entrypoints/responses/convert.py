"""Responses on the chat pipeline: a Responses request (and the conversation of the response it
continues) as a chat completion request, and a chat answer as a response's output items.

A conversation is kept as chat messages (dicts, ``ChatMessage``'s fields), without the
request's ``instructions``: OpenAI does not carry instructions over to a continuation."""

from __future__ import annotations

import uuid
from typing import Any, Optional

from vpage.entrypoints.openai.protocol import ApiError, ChatCompletionRequest
from vpage.entrypoints.responses.protocol import (FunctionCallItem, FunctionCallOutputItem, MessageItem, OtherTool,
                                                  ResponsesRequest)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _called_ids(messages: list[dict]) -> set[str]:
    return {call["id"] for m in messages for call in m.get("tool_calls") or ()}


def conversation(req: ResponsesRequest, history: list[dict]) -> list[dict]:
    """``history`` (an earlier response's conversation) followed by ``req.input`` as chat
    messages. ApiError(400) for what the chat pipeline cannot carry (images, files) and for a
    function_call_output answering no function_call of the conversation."""
    messages = [dict(m) for m in history]  # tool_calls lists are replaced, never changed in place
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    called = _called_ids(messages)
    for i, item in enumerate(req.input):
        if isinstance(item, MessageItem):
            refused = item.refused_part()
            if refused is not None:
                raise ApiError(400, f"{refused} content is not supported by this model", param=f"input[{i}]")
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # calls of one turn share its message
                last["tool_calls"] = [*(last.get("tool_calls") or ()), call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            called.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:
                raise ApiError(400, f"function_call_output for unknown call_id {item.call_id!r}", param=f"input[{i}]")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


def chat_request(req: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat completion request that asks what ``req`` asks, over ``messages``."""
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {"model": req.model, "messages": head + messages, "stream": req.stream,
                            "parallel_tool_calls": req.parallel_tool_calls}
    if req.background:
        raise ApiError(400, "background responses are not supported by vpage", param="background")
    if req.truncation != "disabled":
        raise ApiError(400, "truncation 'auto' is not supported by vpage; shorten the input", param="truncation")
    if req.tools:
        for tool in req.tools:
            if isinstance(tool, OtherTool):
                raise ApiError(400, f"tools of type {tool.type!r} are not supported by vpage; use function tools",
                               param="tools")
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.parameters}} for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    text_format = req.text.format if req.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        if text_format.schema_ is None:
            raise ApiError(400, "a json_schema text format needs a schema", param="text.format.schema")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.name or "response", "schema": text_format.schema_, "strict": text_format.strict}}
    elif text_format is not None and text_format.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.reasoning.effort != "none",
                                        "reasoning_effort": req.reasoning.effort}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.top_logprobs:
        body.update(logprobs=True, top_logprobs=req.top_logprobs)
    for name in ("temperature", "top_p", "top_k", "seed", "user", "cache_salt"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValueError as exc:
        raise ApiError(400, f"the request cannot be served: {str(exc)[:300]}") from None


def status_of(finish_reason: Optional[str]) -> tuple[str, Optional[dict]]:
    """(status, incomplete_details) of a response whose answer finished with ``finish_reason``."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "incomplete", None
    return "completed", None


def text_logprobs(logprobs: Optional[dict]) -> list[dict]:
    """A chat choice's logprobs as output_text logprobs (the same entries)."""
    return list((logprobs or {}).get("content") or [])


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def message_item(item_id: str, text: str, status: str, logprobs: list[dict]) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: dict, logprobs: Optional[dict], status: str) -> list[dict]:
    """The output items of a whole chat answer's message: reasoning, text, function calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"], status))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], status, text_logprobs(logprobs)))
    for call in message.get("tool_calls") or ():
        items.append(function_call_item(new_id("fc"), call["id"], call["function"]["name"],
                                        call["function"]["arguments"], "completed"))
    return items


def assistant_message(items: list[dict]) -> dict:
    """The chat message that output ``items`` stand for in a continued conversation."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


def usage_of(chat_usage: dict, reasoning_tokens: int) -> dict:
    inputs, outputs = chat_usage.get("prompt_tokens", 0), chat_usage.get("completion_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": inputs, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": outputs,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}, "total_tokens": inputs + outputs}


def response_body(req: ResponsesRequest, response_id: str, created_at: int, model: str, status: str,
                  output: list[dict], usage: Optional[dict], incomplete_details: Optional[dict] = None,
                  error: Optional[dict] = None) -> dict:
    """A response object: the answer so far (``output``) and the request's settings echoed."""
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete_details,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning else {"effort": None, "summary": None},
            "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)
                     if req.text and req.text.format else {"type": "text"}},
            "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
                            else req.tool_choice.model_dump()) or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()], "top_logprobs": req.top_logprobs,
            "truncation": req.truncation, "usage": usage, "user": req.user, "metadata": req.metadata or {}}
