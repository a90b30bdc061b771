"""``hermes``: Hermes/Qwen-style calls, one JSON object per ``<tool_call>...</tool_call>`` block.

``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, any number of blocks; the text
around them is the content (whitespace next to a block dropped). A final output may stop after
a call's JSON without its closing tag.
"""

from __future__ import annotations

from vpage.entrypoints.openai.tool_parsers import register
from vpage.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedText, ToolParser
from vpage.entrypoints.openai.tool_parsers.json_calls import Malformed, scan_call, skip_ws
from vpage.reasoning.think_parsers import partial_tail

START, END = "<tool_call>", "</tool_call>"


@register("hermes")
class Hermes2ProToolParser(ToolParser):
    markers = (START, END)

    def parse(self, text: str, final: bool) -> ParsedText:
        content: list[str] = []
        calls = []
        pos, after_block = 0, False
        while True:
            start = text.find(START, pos)
            segment = text[pos:] if start < 0 else text[pos:start]
            if after_block:
                segment = segment.lstrip()
            if start < 0:
                if not final:  # hold back what may still become a block's start, and the space before it
                    segment = segment[:len(segment) - partial_tail(segment, START)].rstrip()
                content.append(segment)
                return ParsedText("".join(content), calls)
            content.append(segment.rstrip())
            j = skip_ws(text, start + len(START))
            if j >= len(text):
                return ParsedText("".join(content), calls)
            try:
                if text[j] != "{":
                    raise Malformed("a tool call must be a JSON object")
                end, call = scan_call(text, j, final)
            except Malformed:
                return ParsedText("".join(content), calls, valid=False)
            calls.append(call)
            k = skip_ws(text, end) if end is not None else len(text)
            if end is None or k >= len(text) or (not final and END.startswith(text[k:])):
                return ParsedText("".join(content), calls)  # the call, or its closing tag, still to come
            if not text.startswith(END, k):
                return ParsedText("".join(content), calls, valid=False)
            pos, after_block = k + len(END), True
