"""``pythonic``: calls written as a Python list of keyword-argument calls (Llama 3.2/4 style),
``[get_weather(city="Paris"), get_time(zone="CET")]``.

The output is a tool call when it starts with ``[``; argument values are Python literals
(strings, numbers, True/False/None, lists, tuples, dicts) and become JSON. A call's name is
streamed when its ``(`` arrives and its arguments when its ``)`` closes it.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Optional

from vpage.entrypoints.openai.tool_parsers import register
from vpage.entrypoints.openai.tool_parsers.abstract_tool_parser import CallPrefix, ParsedText, ToolParser
from vpage.entrypoints.openai.tool_parsers.json_calls import skip_ws

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def _call_end(text: str, i: int) -> Optional[int]:
    """End (after the matching ``)``) of the argument list opening at ``text[i] == "("``,
    skipping brackets inside string literals; None when the text ends first."""
    depth, quote, j = 0, None, i
    while j < len(text):
        c = text[j]
        if quote is not None:
            if c == "\\":
                j += 2
                continue
            if text.startswith(quote, j):
                j += len(quote)
                quote = None
                continue
        elif c in "'\"":
            quote = c * 3 if text.startswith(c * 3, j) else c
            j += len(quote)
            continue
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _json(value):
    """A literal's value as JSON data (tuples become lists); ValueError for other types."""
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("argument dict keys must be strings")
        return {k: _json(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} is not a JSON number")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise ValueError(f"{type(value).__name__} is not a JSON value")


def _arguments(call_text: str) -> str:
    """The keyword arguments of one call expression, as JSON text."""
    node = ast.parse(call_text, mode="eval").body
    if not isinstance(node, ast.Call) or node.args or any(kw.arg is None for kw in node.keywords):
        raise ValueError("a tool call takes keyword arguments only")
    return json.dumps({kw.arg: _json(ast.literal_eval(kw.value)) for kw in node.keywords}, ensure_ascii=False)


@register("pythonic")
class PythonicToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        i = skip_ws(text, 0)
        if i >= len(text):
            return ParsedText(text if final else "")
        if text[i] != "[":
            return ParsedText(text)
        calls: list[CallPrefix] = []
        j = i + 1
        while True:
            j = skip_ws(text, j)
            if j >= len(text):
                return ParsedText("", calls)
            if text[j] == "]" and not calls:
                return ParsedText("", calls, valid=False)  # an empty list calls nothing
            match = _NAME.match(text, j)
            if match is None:
                return ParsedText("", calls, valid=False)
            k = match.end()
            if k >= len(text):
                return ParsedText("", calls)
            if text[k] != "(":
                return ParsedText("", calls, valid=False)
            call = CallPrefix(name=match.group())
            calls.append(call)
            end = _call_end(text, k)
            if end is None:
                return ParsedText("", calls)
            try:
                call.arguments = _arguments(text[j:end])
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                return ParsedText("", calls, valid=False)
            call.done = True
            j = skip_ws(text, end)
            if j >= len(text):
                return ParsedText("", calls)
            if text[j] == "]":
                valid = not text[j + 1:].strip()
                return ParsedText("", calls, valid=valid)
            if text[j] != ",":
                return ParsedText("", calls, valid=False)
            j += 1
