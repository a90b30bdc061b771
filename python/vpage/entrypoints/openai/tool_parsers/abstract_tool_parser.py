"""What every tool-call format shares: a parse of the text so far into content and call
prefixes, and from it the whole answer's ``tool_calls`` or the stream's tool-call deltas.

A format implements ``parse(text, final)``. While ``final`` is False the result must only grow
as text is appended: the content and each call's arguments are prefixes of what a longer text
gives, and a call's name is set only once it is complete. Streaming then sends the difference
from what it sent before, so the deltas add up to the whole text's answer.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Optional


def make_tool_call_id() -> str:
    """vLLM's tool call id: ``chatcmpl-tool-`` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class CallPrefix:
    """A tool call as far as the text shows it."""

    name: Optional[str] = None  # set once the name is complete
    arguments: str = ""  # a prefix of the call's arguments (JSON text); whole when done
    done: bool = False


@dataclass
class ParsedText:
    """Text outside the calls (a prefix of the final content unless final) and the calls."""

    content: str
    calls: list[CallPrefix] = field(default_factory=list)
    valid: bool = True  # False: the text breaks the format, so it is all content


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolParser:
    """A tool-call format (``--tool-call-parser``). One instance per streamed choice: it
    remembers what it has streamed."""

    # The format's tags; when the tokenizer has one as a special token, the output must keep
    # special tokens (skip_special_tokens=False) for the parser to see it.
    markers: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._content_sent = 0  # characters of content streamed
        self._calls_sent: list[list] = []  # per call: [id, characters of arguments streamed]

    def parse(self, text: str, final: bool) -> ParsedText:
        raise NotImplementedError

    def make_call_id(self) -> str:
        return make_tool_call_id()

    def extract_tool_calls(self, text: str) -> tuple[Optional[str], list[dict]]:
        """A whole output -> (content, tool calls). Text that does not follow the format, or
        a call cut short, leaves the whole text as content and no calls."""
        parsed = self.parse(text, final=True)
        if not parsed.valid or not parsed.calls or not all(c.done and c.name for c in parsed.calls):
            return text, []
        content = parsed.content if parsed.content.strip() else None
        return content, [tool_call(self.make_call_id(), c.name, c.arguments) for c in parsed.calls]

    @property
    def tools_called(self) -> bool:
        """Whether the stream has sent a tool call."""
        return bool(self._calls_sent)

    def extract_tool_calls_streaming(self, previous_text: str, delta_text: str,
                                     final: bool = False) -> tuple[str, list[dict]]:
        """The content piece and OpenAI tool-call deltas that ``delta_text`` adds to an output
        whose text so far is ``previous_text``: a call's first delta carries its index, id,
        type and name, the later ones pieces of its arguments."""
        text = previous_text + delta_text
        parsed = self.parse(text, final)
        if not parsed.valid and not self._calls_sent:
            parsed = ParsedText(text)  # not a tool call after all: everything is content
        content = parsed.content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(parsed.content))
        deltas = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # a call's name goes first, and calls go in order
            if index == len(self._calls_sent):
                self._calls_sent.append([self.make_call_id(), len(call.arguments)])
                deltas.append({"index": index, "id": self._calls_sent[index][0], "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                continue
            sent = self._calls_sent[index][1]
            if len(call.arguments) > sent:
                self._calls_sent[index][1] = len(call.arguments)
                deltas.append({"index": index, "function": {"arguments": call.arguments[sent:]}})
        return content, deltas
