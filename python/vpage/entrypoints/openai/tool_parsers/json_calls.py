"""Scanning tool calls written as JSON objects (``{"name": ..., "arguments": {...}}``) in text
that may still be growing.

The scanners find where values end without decoding them (strings, nesting), so a call's
arguments can be streamed as the raw text of their value while it is being written; a call is
decoded with ``json.loads`` once its object is complete. They return None for "the text ends
before this is complete" and raise ``Malformed`` when the text cannot be the format.
"""

from __future__ import annotations

import json
from typing import Optional

from vpage.entrypoints.openai.tool_parsers.abstract_tool_parser import CallPrefix

ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"
_SCALAR = set("+-.0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class Malformed(ValueError):
    """The text breaks the format."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_string(text: str, i: int) -> Optional[int]:
    """End (after the closing quote) of the JSON string opening at ``text[i]``."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
        elif c == '"':
            return j + 1
        else:
            j += 1
    return None


def scan_value(text: str, i: int, final: bool) -> Optional[int]:
    """End of the JSON value starting at ``text[i]``. A number or literal that reaches the end
    of the text is complete only when ``final``."""
    c = text[i]
    if c == '"':
        return scan_string(text, i)
    if c in "{[":
        closers: list[str] = []
        j = i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = scan_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                closers.append("}" if c == "{" else "]")
            elif c in "}]":
                if not closers or closers.pop() != c:
                    raise Malformed(f"unbalanced {c!r}")
                if not closers:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] in _SCALAR:
        j += 1
    if j == i:
        raise Malformed(f"no JSON value at {c!r}")
    return None if j == len(text) and not final else j


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _loads(text: str):
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise Malformed(str(exc)) from None


def scan_call(text: str, i: int, final: bool, argument_keys: tuple[str, ...] = ARGUMENT_KEYS
              ) -> tuple[Optional[int], CallPrefix]:
    """The call object opening at ``text[i] == "{"``: (its end or None, the call so far). The
    arguments are the raw text of the value under the first of ``argument_keys`` ("{}" when
    absent; a JSON string value is decoded, and shown only when complete)."""
    call = CallPrefix()
    span: Optional[tuple[int, int]] = None
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return None, call
        if text[j] == "}":
            break
        if text[j] != '"':
            raise Malformed("an object key must be a string")
        end = scan_string(text, j)
        if end is None:
            return None, call
        key = _loads(text[j:end])
        j = skip_ws(text, end)
        if j >= len(text):
            return None, call
        if text[j] != ":":
            raise Malformed("':' expected after an object key")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return None, call
        end = scan_value(text, j, final)
        if key == "name" and call.name is None:
            if end is None:
                return None, call
            name = _loads(text[j:end])
            if not isinstance(name, str) or not name:
                raise Malformed("a tool call's name must be a non-empty string")
            call.name = name
        elif key in argument_keys and span is None:
            if end is None:
                if text[j] != '"':
                    call.arguments = text[j:]
                return None, call
            span = (j, end)
            call.arguments = text[j:end] if text[j] != '"' else _loads(text[j:end])
        elif end is None:
            return None, call
        j = skip_ws(text, end)
        if j >= len(text):
            return None, call
        if text[j] == "}":
            break
        if text[j] != ",":
            raise Malformed("',' or '}' expected in an object")
        j += 1
    _loads(text[i:j + 1])  # the whole object must be JSON (escapes, trailing commas, literals)
    if call.name is None:
        raise Malformed("a tool call has no name")
    if span is None:
        call.arguments = "{}"
    call.done = True
    return j + 1, call


def scan_calls(text: str, i: int, final: bool, separator: str, closer: Optional[str],
               argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> tuple[Optional[int], list[CallPrefix]]:
    """Call objects from ``text[i]`` separated by ``separator``: the items of a JSON array
    (``i`` after its ``[``, ``closer`` "]") or a bare sequence (``closer`` None, which ends where
    no separator follows a call; only at the end of a final text). Returns (the end, or None
    while more may come; the calls so far)."""
    calls: list[CallPrefix] = []
    j = i
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return None, calls
        if closer is not None and text[j] == closer and not calls:
            return j + 1, calls
        if text[j] != "{":
            raise Malformed("a tool call must be a JSON object")
        end, call = scan_call(text, j, final, argument_keys)
        calls.append(call)
        if end is None:
            return None, calls
        j = skip_ws(text, end)
        if j >= len(text):
            return (j if closer is None and final else None), calls
        if text[j] == separator:
            j += 1
        elif closer is not None and text[j] == closer:
            return j + 1, calls
        elif closer is None:
            return j, calls
        else:
            raise Malformed(f"{separator!r} expected between tool calls")
