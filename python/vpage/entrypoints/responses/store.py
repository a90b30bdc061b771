"""Stored responses (``store: true``), for ``previous_response_id`` and ``GET``/``DELETE
/v1/responses/{id}``: in memory, at most ``max_responses`` (the least recently used go first),
each visible only to the API key (tenant) that created it."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


@dataclass
class StoredResponse:
    body: dict  # the response object as answered
    messages: list[dict]  # its conversation as chat messages, its output included (no instructions)


class ResponseStore:
    def __init__(self, max_responses: int = 1024):
        if max_responses < 0:
            raise ValueError(f"max_responses must be >= 0, got {max_responses}")
        self.max_responses = max_responses
        self._responses: OrderedDict[tuple[Optional[str], str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, tenant: Optional[str], stored: StoredResponse) -> None:
        if self.max_responses == 0:
            return
        key = (tenant, stored.body["id"])
        self._responses[key] = stored
        self._responses.move_to_end(key)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, tenant: Optional[str], response_id: str) -> Optional[StoredResponse]:
        stored = self._responses.get((tenant, response_id))
        if stored is not None:
            self._responses.move_to_end((tenant, response_id))
        return stored

    def delete(self, tenant: Optional[str], response_id: str) -> bool:
        return self._responses.pop((tenant, response_id), None) is not None
