"""Loops in tests end by themselves: a polling or stepping loop runs through ``bounded``,
which fails the test with a message instead of spinning forever when its cap is reached."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest


def bounded(condition: Callable[[], bool], limit: int, what: str) -> Iterator[int]:
    """``for i in bounded(cond, limit, what)`` is ``while cond()`` for at most ``limit``
    iterations; if ``cond()`` still holds after them, the test fails with ``what``."""
    for i in range(limit):
        if not condition():
            return
        yield i
    if condition():
        pytest.fail(f"{what} after {limit} iterations")


def run_requests(engine, requests: list) -> list:
    """Adds ``requests`` ((prompt, SamplingParams) pairs, ids "0", "1", ...) to ``engine`` and
    steps it until all finish, checking the scheduler's invariants after every step; returns
    each request's final RequestOutput, in request order."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    done = {}
    for _ in bounded(engine.has_unfinished_requests, 10_000, "requests still unfinished"):
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        engine.scheduler.check_invariants()
    return [done[i] for i in range(len(requests))]
