"""``mistral``: Mistral's calls, ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}``.

The text before ``[TOOL_CALLS]`` is the content. ``[TOOL_CALLS]`` is a special token of Mistral's
tokenizers, so the output keeps special tokens while this parser reads it. Mistral's chat
templates want tool call ids of 9 letters and digits, so this parser makes those.
"""

from __future__ import annotations

import random
import string

from vpage.entrypoints.openai.tool_parsers import register
from vpage.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedText, ToolParser
from vpage.entrypoints.openai.tool_parsers.json_calls import Malformed, scan_calls, skip_ws
from vpage.reasoning.think_parsers import partial_tail

TOOL_CALLS = "[TOOL_CALLS]"
_ID_CHARS = string.ascii_letters + string.digits


@register("mistral")
class MistralToolParser(ToolParser):
    markers = (TOOL_CALLS,)

    def make_call_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def parse(self, text: str, final: bool) -> ParsedText:
        start = text.find(TOOL_CALLS)
        if start < 0:
            if final:
                return ParsedText(text)
            return ParsedText(text[:len(text) - partial_tail(text, TOOL_CALLS)].rstrip())
        content = text[:start].rstrip()
        j = skip_ws(text, start + len(TOOL_CALLS))
        if j >= len(text):
            return ParsedText(content)
        try:
            if text[j] != "[":
                raise Malformed("[TOOL_CALLS] must be followed by a JSON array")
            end, calls = scan_calls(text, j + 1, final, ",", "]")
        except Malformed:
            return ParsedText(content, valid=False)
        if end is not None and text[end:].strip():
            return ParsedText(content, calls, valid=False)
        return ParsedText(content, calls)
