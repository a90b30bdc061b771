"""Which waiting pooling requests run together: first come, first served, packed up to a
token budget. A pooling request runs whole in one step (bidirectional attention needs the
whole sequence), so a step's batch is a prefix of the queue."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from vpage.pooling_params import PoolingParams


@dataclass
class PoolingRequest:
    request_id: str
    prompt_token_ids: list[int]
    token_type_ids: Optional[list[int]]
    params: PoolingParams  # verified for the request's task


class PoolingScheduler:
    """The waiting queue. ``schedule()`` plans a step without changing the queue; ``finish``
    removes what ran (a step that fails leaves every request queued)."""

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: dict[str, PoolingRequest] = {}  # arrival order

    def __len__(self) -> int:
        return len(self.waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.waiting

    def add(self, request: PoolingRequest) -> None:
        self.waiting[request.request_id] = request

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.waiting.pop(request_id, None)

    def schedule(self) -> list[PoolingRequest]:
        """The oldest requests whose tokens fit ``max_num_batched_tokens`` together, at most
        ``max_num_seqs``, stopping at the first that does not fit; the oldest alone when it is
        longer than the budget (requests were checked against max_model_len)."""
        batch: list[PoolingRequest] = []
        tokens = 0
        for request in self.waiting.values():
            n = len(request.prompt_token_ids)
            if batch and (tokens + n > self.max_num_batched_tokens or len(batch) == self.max_num_seqs):
                break
            batch.append(request)
            tokens += n
        return batch

    def finish(self, batch: list[PoolingRequest]) -> None:
        for request in batch:
            del self.waiting[request.request_id]
