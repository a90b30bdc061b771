"""Reasoning parsers: where a model's thinking ends, and how to split it from the answer.

``get_reasoning_parser(name)(tokenizer)`` builds one (``--reasoning-parser``). The engine asks
``is_reasoning_end`` to know when a structured-output constraint starts; the server splits
``reasoning_content`` from ``content`` with the extract methods.
"""

from __future__ import annotations

from typing import Any, Sequence


class ReasoningParser:
    """Interface of a reasoning format; one instance per tokenizer, shared by requests."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the reasoning has ended within ``token_ids`` (a request's prompt and output so
        far): what follows is the answer."""
        raise NotImplementedError

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """A whole output's text -> (reasoning_content, content)."""
        raise NotImplementedError


_PARSERS: dict[str, type[ReasoningParser]] = {}


def register(name: str):
    """Class decorator adding a parser under ``name``."""
    def add(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        _PARSERS[name] = cls
        return cls
    return add


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``; ValueError listing the known ones otherwise."""
    if name not in _PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {reasoning_parser_names()}")
    return _PARSERS[name]
