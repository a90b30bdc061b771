"""``llama3_json``: Llama 3.1+ JSON calls, ``{"name": "f", "parameters": {...}}``.

The output is a tool call when it starts (after optional whitespace and ``<|python_tag|>``)
with ``{``; several calls are separated by ``;``. Any other output is content.
"""

from __future__ import annotations

from vpage.entrypoints.openai.tool_parsers import register
from vpage.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedText, ToolParser
from vpage.entrypoints.openai.tool_parsers.json_calls import Malformed, scan_calls, skip_ws

PYTHON_TAG = "<|python_tag|>"


@register("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        lead = text.lstrip()
        i = len(text) - len(lead)
        if lead.startswith(PYTHON_TAG):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(lead):
            return ParsedText("")  # nothing yet, or the start of the tag: undecided
        if i >= len(text):
            return ParsedText("" if not final else text)
        if text[i] != "{":
            return ParsedText(text)
        try:
            end, calls = scan_calls(text, i, final, ";", None)
        except Malformed:
            return ParsedText("", valid=False)
        if end is not None and text[end:].strip():
            return ParsedText("", calls, valid=False)
        return ParsedText("", calls)
