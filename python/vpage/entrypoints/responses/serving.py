"""``/v1/responses``: a Responses request continues its ``previous_response_id``'s conversation,
runs as a chat completion (templates, tool parsers, constraints), and is answered as a response
object or a stream of semantic events; ``store`` keeps it for later turns, GET and DELETE."""

from __future__ import annotations

import time
from typing import AsyncIterator, Awaitable, Callable, Optional

from vpage.entrypoints.openai.auth import cache_salt
from vpage.entrypoints.openai.protocol import ApiError
from vpage.entrypoints.openai.serving import OpenAIServing, Submission
from vpage.entrypoints.responses.convert import (assistant_message, chat_request, conversation, output_items,
                                                 response_body, status_of, usage_of)
from vpage.entrypoints.responses.events import response_events
from vpage.entrypoints.responses.protocol import ResponsesRequest
from vpage.entrypoints.responses.store import ResponseStore, StoredResponse


class _Turn:
    """One admitted Responses request: its chat submission, its conversation, and how its
    response object is made and kept."""

    def __init__(self, owner: "ResponsesServing", req: ResponsesRequest, tenant: Optional[str],
                 messages: list[dict], sub: Submission):
        self.owner, self.req, self.tenant, self.messages, self.sub = owner, req, tenant, messages, sub
        self.id = "resp_" + sub.builder.id.removeprefix("chatcmpl-")
        self.created_at = int(time.time())

    def body(self, status: str, output: list[dict], usage: Optional[dict], incomplete_details: Optional[dict] = None,
             error: Optional[dict] = None) -> dict:
        return response_body(self.req, self.id, self.created_at, self.owner.serving.model_name, status, output, usage,
                             incomplete_details, error)

    def keep(self, final: dict) -> None:
        if self.req.store:
            self.owner.store.put(self.tenant, StoredResponse(final, self.messages + [assistant_message(final["output"])]))


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore):
        self.serving = serving
        self.store = store

    def _reasoning_tokens(self, text: Optional[str]) -> int:
        """The reasoning's token count (its text encoded again: the output is not split by token)."""
        tokenizer = self.serving.client.tokenizer
        return len(tokenizer.encode(text, add_special_tokens=False)) if text and tokenizer is not None else 0

    def submit(self, req: ResponsesRequest, tenant: Optional[str]) -> _Turn:
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = self.store.get(tenant, req.previous_response_id)
            if previous is None:
                raise ApiError(404, f"previous response with id {req.previous_response_id!r} not found",
                               kind="not_found_error", param="previous_response_id")
            history = previous.messages
        messages = conversation(req, history)
        chat = chat_request(req, messages)
        return _Turn(self, req, tenant, messages, self.serving.submit(chat, cache_salt(tenant, chat.cache_salt)))

    async def respond(self, turn: _Turn, disconnected: Callable[[], Awaitable[None]]) -> dict:
        """The whole response object."""
        chat = await self.serving.respond(turn.sub, disconnected)
        choice = chat["choices"][0]
        status, incomplete = status_of(choice["finish_reason"])
        message = choice["message"]
        final = turn.body(status, output_items(message, choice.get("logprobs"), status),
                          usage_of(chat["usage"], self._reasoning_tokens(message.get("reasoning_content"))),
                          incomplete)
        turn.keep(final)
        return final

    def events(self, turn: _Turn, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The semantic events of the chat stream ``chunks`` (already started)."""
        return response_events(chunks, turn.body, self._reasoning_tokens, turn.keep)

    def retrieve(self, tenant: Optional[str], response_id: str) -> dict:
        stored = self.store.get(tenant, response_id)
        if stored is None:
            raise ApiError(404, f"response with id {response_id!r} not found", kind="not_found_error")
        return stored.body

    def delete(self, tenant: Optional[str], response_id: str) -> dict:
        if not self.store.delete(tenant, response_id):
            raise ApiError(404, f"response with id {response_id!r} not found", kind="not_found_error")
        return {"id": response_id, "object": "response.deleted", "deleted": True}
