"""Reasoning parsers: where a model's thinking ends, and how to split it from the answer.

``get_reasoning_parser(name)(tokenizer)`` builds one (``--reasoning-parser``). The engine asks
``is_reasoning_end`` to know when a structured-output constraint starts; the server splits
``reasoning_content`` from ``content`` with the extract methods. Importing this package
registers the built-in parsers, ``deepseek_r1`` and ``qwen3`` (think_parsers.py).
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

    def extract_reasoning(self, text: str, prompt_token_ids: Sequence[int] = ()) -> tuple[str | None, str | None]:
        """A whole output's text -> (reasoning_content, content), None for an empty part.
        ``prompt_token_ids`` tell whether the chat template already opened (or closed) the
        reasoning in the prompt."""
        raise NotImplementedError

    def extract_reasoning_streaming(self, previous_text: str, delta_text: str, prompt_token_ids: Sequence[int] = (),
                                    final: bool = False) -> tuple[str, str]:
        """The (reasoning, content) pieces that ``delta_text`` adds to an output whose text so
        far was ``previous_text``; "" for nothing. Text that could still turn into a tag is
        held back until it is decided, or until ``final`` (the output's last delta). The
        pieces of all deltas add up to what ``extract_reasoning`` gives the whole text."""
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


from vpage.reasoning import think_parsers  # noqa: E402,F401  (registers deepseek_r1 and qwen3)
