"""A chat stream as the Responses API's semantic events: ``response.created``,
``response.in_progress``, per output item ``response.output_item.added`` ... ``.done`` with its
deltas (``response.reasoning_text.delta``, ``response.output_text.delta``,
``response.function_call_arguments.delta``), then ``response.completed`` (or
``response.incomplete``; ``error`` and ``response.failed`` when the engine fails). Every event
carries a ``sequence_number``; the last one holds the whole response, built from the same items
the deltas added up to."""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable, Optional

from vpage.entrypoints.openai.serving import chat_chunks
from vpage.entrypoints.responses.convert import (function_call_item, message_item, new_id, reasoning_item, status_of,
                                                 text_logprobs, usage_of)


class _Items:
    """The output items of a streamed response: the open one (kind, key, item) and those done."""

    def __init__(self, event: Callable[..., bytes]):
        self.event = event
        self.done: list[dict] = []
        self.open: Optional[tuple[str, object, dict]] = None

    @property
    def index(self) -> int:
        return len(self.done)

    def switch(self, kind: str, key: object, make: Callable[[], dict]) -> list[bytes]:
        """Events that close the open item unless it is (kind, key), then open a new one."""
        if self.open is not None and self.open[:2] == (kind, key):
            return []
        events = self.close("completed")
        item = make()
        self.open = (kind, key, item)
        events.append(self.event("response.output_item.added", output_index=self.index, item=dict(item, **(
            {"content": []} if kind == "message" else {}))))
        if kind in ("message", "reasoning"):
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                                     content_index=0, part=dict(item["content"][0])))
        return events

    def close(self, status: str) -> list[bytes]:
        if self.open is None:
            return []
        kind, _, item = self.open
        self.open = None
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self.index}
        if kind == "function_call":
            item["status"] = "completed"
            events = [self.event("response.function_call_arguments.done", **where, arguments=item["arguments"],
                                 name=item["name"])]
        else:
            part = item["content"][0]
            done = ("response.output_text.done" if kind == "message" else "response.reasoning_text.done")
            extra = {"logprobs": part["logprobs"]} if kind == "message" else {}
            events = [self.event(done, **where, content_index=0, text=part["text"], **extra),
                      self.event("response.content_part.done", **where, content_index=0, part=part)]
        events.append(self.event("response.output_item.done", output_index=self.index, item=item))
        self.done.append(item)
        return events


async def response_events(chunks: AsyncIterator[bytes], body: Callable[..., dict],
                          count_tokens: Callable[[str], int],
                          on_complete: Callable[[dict], None]) -> AsyncIterator[bytes]:
    """The Responses events of the chat pipeline's stream (``data: {chunk}`` events).
    ``body(status, output, usage, incomplete_details=None, error=None)`` makes the response
    object; ``on_complete`` gets the last one (completed or incomplete) to store."""
    sequence = 0

    def event(kind: str, **fields) -> bytes:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    yield event("response.created", response=body("in_progress", [], None))
    yield event("response.in_progress", response=body("in_progress", [], None))
    items = _Items(event)
    finish_reason: Optional[str] = None
    chat_usage: dict = {}
    reasoning = ""
    async for chunk in chat_chunks(chunks):
        if "error" in chunk:
            error = chunk["error"]
            yield event("error", code=str(error.get("code") or 500), message=error.get("message", ""),
                        param=error.get("param"))
            yield event("response.failed", response=body("failed", items.done, None, error={
                "code": "server_error", "message": error.get("message", "")}))
            return
        chat_usage = chunk.get("usage") or chat_usage
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                for e in items.switch("reasoning", None, lambda: reasoning_item(new_id("rs"), "", "in_progress")):
                    yield e
                reasoning += delta["reasoning_content"]
                item = items.open[2]
                item["content"][0]["text"] += delta["reasoning_content"]
                yield event("response.reasoning_text.delta", item_id=item["id"], output_index=items.index,
                            content_index=0, delta=delta["reasoning_content"])
            if delta.get("content"):
                for e in items.switch("message", None, lambda: message_item(new_id("msg"), "", "in_progress", [])):
                    yield e
                item = items.open[2]
                part = item["content"][0]
                logprobs = text_logprobs(choice.get("logprobs"))
                part["text"] += delta["content"]
                part["logprobs"] += logprobs
                yield event("response.output_text.delta", item_id=item["id"], output_index=items.index,
                            content_index=0, delta=delta["content"], logprobs=logprobs)
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                for e in items.switch("function_call", call["index"], lambda: function_call_item(
                        new_id("fc"), call.get("id") or new_id("call"), function.get("name") or "", "",
                        "in_progress")):
                    yield e
                item = items.open[2]
                if function.get("arguments"):
                    item["arguments"] += function["arguments"]
                    yield event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=items.index, delta=function["arguments"])
            if choice.get("finish_reason") is not None:
                finish_reason = choice["finish_reason"]
    status, incomplete = status_of(finish_reason)
    for e in items.close(status):
        yield e
    final = body(status, items.done, usage_of(chat_usage, count_tokens(reasoning) if reasoning else 0), incomplete)
    on_complete(final)
    yield event("response.completed" if status == "completed" else "response.incomplete", response=final)
