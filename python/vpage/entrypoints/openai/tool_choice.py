"""``tool_choice``: which tool calls a chat request allows, and for ``"required"`` and a named
function the JSON schema that makes the answer a valid call (vLLM's shapes):

- named: the output is that function's arguments, so the schema is its ``parameters``;
- ``"required"``: the output is a JSON array (one item at most unless ``parallel_tool_calls``)
  of ``{"name": <a tool's name>, "parameters": <that tool's arguments>}``.

The two parsers here read those outputs back into tool calls, whole or streamed.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from vpage.entrypoints.openai.protocol import ApiError, ChatCompletionNamedToolChoiceParam, ChatCompletionRequest
from vpage.entrypoints.openai.tool_parsers.abstract_tool_parser import CallPrefix, ParsedText, ToolParser
from vpage.entrypoints.openai.tool_parsers.json_calls import Malformed, scan_calls, skip_ws

ToolChoice = Union[str, ChatCompletionNamedToolChoiceParam]
_NO_PARAMETERS = {"type": "object", "properties": {}}


def resolve_tool_choice(req: ChatCompletionRequest) -> ToolChoice:
    """The request's tool_choice ("auto" when it sends tools and no choice, else "none"),
    checked against its tools (400s as vLLM words them)."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    if choice != "none" and not req.tools:
        raise ApiError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        name = choice.function.name
        if all(tool.function.name != name for tool in req.tools):
            raise ApiError(400, f"Tool '{name}' has not been passed in `tools`.", param="tool_choice")
    return choice


def _parameters(tool) -> dict:
    return tool.function.parameters or _NO_PARAMETERS


def tool_choice_schema(req: ChatCompletionRequest, choice: ToolChoice) -> Optional[dict]:
    """The JSON schema that constrains the answer of a "required" or named tool_choice; None
    for the others."""
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return next(_parameters(t) for t in req.tools if t.function.name == choice.function.name)
    if choice != "required":
        return None
    defs: dict[str, Any] = {}
    items = []
    for tool in req.tools:
        parameters = dict(_parameters(tool))
        # References ("#/$defs/X") resolve from the root of the schema, so the $defs go there.
        for key, value in (parameters.pop("$defs", None) or {}).items():
            if defs.get(key, value) != value:
                raise ApiError(400, f"tools define `$defs/{key}` in different ways", param="tools")
            defs[key] = value
        items.append({"type": "object", "properties": {"name": {"type": "string", "const": tool.function.name},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class NamedToolParser(ToolParser):
    """A named tool_choice: the whole output is the arguments of that function."""

    def __init__(self, tokenizer: Any, name: str):
        super().__init__(tokenizer)
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedText:
        return ParsedText("", [CallPrefix(self.name, text.strip(), done=final)])


class RequiredToolParser(ToolParser):
    """tool_choice "required": the output is the JSON array of ``{"name", "parameters"}``."""

    def parse(self, text: str, final: bool) -> ParsedText:
        i = skip_ws(text, 0)
        if i >= len(text):
            return ParsedText("", valid=not final)
        try:
            if text[i] != "[":
                raise Malformed("the tool calls must be a JSON array")
            end, calls = scan_calls(text, i + 1, final, ",", "]", argument_keys=("parameters",))
        except Malformed:
            return ParsedText("", valid=False)
        return ParsedText("", calls, valid=end is None or not text[end:].strip())
