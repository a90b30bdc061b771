"""A chat answer read as the model wrote it: reasoning split from the content first
(``--reasoning-parser``), then tool calls read from the content (``--tool-call-parser`` for
``tool_choice: "auto"``, or the JSON of a "required" or named tool_choice). Whole answers get a
message with ``reasoning_content`` and ``tool_calls``; streams get deltas of the same, which add
up to it. A choice that called tools and stopped by itself finishes with ``"tool_calls"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from vpage.entrypoints.openai.tool_parsers import ToolParser
from vpage.reasoning import ReasoningParser


@dataclass
class _ChoiceStream:
    """What one streamed choice has produced so far."""

    text: str = ""  # the output
    content: str = ""  # the output after its reasoning (what the tool parser reads)
    tool_parser: Optional[ToolParser] = None


class ChatOutput:
    """How the outputs of one chat request become messages (one per request; choices by index)."""

    def __init__(self, prompt_token_ids: list[int], reasoning: Optional[ReasoningParser],
                 make_tool_parser: Optional[Callable[[], ToolParser]], include_reasoning: bool = True,
                 parallel_tool_calls: bool = True):
        self.prompt_token_ids = prompt_token_ids
        self.reasoning = reasoning
        self.make_tool_parser = make_tool_parser
        self.include_reasoning = include_reasoning
        self.parallel_tool_calls = parallel_tool_calls
        self._streams: dict[int, _ChoiceStream] = {}

    @staticmethod
    def _finish(reason: Optional[str], called: bool) -> Optional[str]:
        return "tool_calls" if called and reason == "stop" else reason

    def message(self, text: str, reason: Optional[str]) -> tuple[dict, Optional[str]]:
        """The message of a whole output ``text`` and its finish reason."""
        message: dict = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            reasoning, message["content"] = self.reasoning.extract_reasoning(text, self.prompt_token_ids)
            message["reasoning_content"] = reasoning if self.include_reasoning else None
        calls: list[dict] = []
        if self.make_tool_parser is not None:
            content, calls = self.make_tool_parser().extract_tool_calls(message["content"] or "")
            if calls:
                message["content"] = content
                message["tool_calls"] = calls if self.parallel_tool_calls else calls[:1]
        return message, self._finish(reason, bool(calls))

    def delta(self, index: int, text: str, reason: Optional[str]) -> tuple[dict, Optional[str]]:
        """The delta fields (content, reasoning_content, tool_calls) that ``text`` adds to choice
        ``index``, and its finish reason; a finish reason flushes what was held back."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = _ChoiceStream(
                tool_parser=self.make_tool_parser() if self.make_tool_parser is not None else None)
        final = reason is not None
        fields: dict = {}
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning_streaming(stream.text, text, self.prompt_token_ids,
                                                                            final)
            stream.text += text
            if reasoning and self.include_reasoning:
                fields["reasoning_content"] = reasoning
        if stream.tool_parser is not None:
            piece = content
            content, calls = stream.tool_parser.extract_tool_calls_streaming(stream.content, piece, final)
            stream.content += piece
            if not self.parallel_tool_calls:
                calls = [c for c in calls if c["index"] == 0]
            if calls:
                fields["tool_calls"] = calls
            reason = self._finish(reason, stream.tool_parser.tools_called)
        if content:
            fields["content"] = content
        return fields, reason
