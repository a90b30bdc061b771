"""Tool-call parsers (``--tool-call-parser``): the formats models write tool calls in, turned
into OpenAI ``tool_calls`` for whole answers and tool-call deltas for streams.

``get_tool_parser(name)(tokenizer)`` builds one; importing this package registers ``hermes``,
``llama3_json``, ``mistral`` and ``pythonic``.
"""

from __future__ import annotations

from vpage.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser

_PARSERS: dict[str, type[ToolParser]] = {}


def register(name: str):
    """Class decorator adding a parser under ``name``."""
    def add(cls: type[ToolParser]) -> type[ToolParser]:
        _PARSERS[name] = cls
        return cls
    return add


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; ValueError naming the choices otherwise."""
    if name not in _PARSERS:
        raise ValueError(f"invalid tool call parser: {name!r} (choose from {', '.join(tool_parser_names())})")
    return _PARSERS[name]


from vpage.entrypoints.openai.tool_parsers import (  # noqa: E402,F401  (register the parsers)
    hermes_tool_parser, llama_tool_parser, mistral_tool_parser, pythonic_tool_parser)
