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
