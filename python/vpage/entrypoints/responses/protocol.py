"""OpenAI Responses request bodies (strict pydantic models): ``input`` as text or items
(messages, ``function_call``, ``function_call_output``, ``reasoning``), function tools,
``text.format`` and the sampling fields. Items without a ``type`` are messages, as OpenAI's
"easy input messages" are."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

_INT32 = 2**31 - 1
_INT64 = 2**63 - 1
Name = Annotated[str, Field(min_length=1, max_length=256)]
CallId = Annotated[str, Field(min_length=1, max_length=256)]


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send fields vpage has no use for: annotations, ...).
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class FilePart(_Strict):
    """An image or a file: refused, with the part named (this server reads text only)."""

    type: Literal["input_image", "input_file", "input_audio", "refusal"]


def _part_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text" if kind in ("input_text", "output_text", "text") else "other"


Part = Annotated[Union[Annotated[TextPart, Tag("text")], Annotated[FilePart, Tag("other")]],
                 Discriminator(_part_tag)]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, Annotated[list[Part], Field(max_length=4096)]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def refused_part(self) -> Optional[str]:
        """The type of a part this server cannot read, if any."""
        if isinstance(self.content, str):
            return None
        return next((p.type for p in self.content if isinstance(p, FilePart)), None)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: CallId
    name: Name
    arguments: str
    id: Optional[str] = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: CallId
    output: Union[str, Annotated[list[Part], Field(max_length=4096)]]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text for p in self.output if isinstance(p, TextPart))


class ReasoningItem(_Strict):
    """An earlier turn's reasoning: accepted and not sent back to the model (as chat templates
    drop the reasoning of earlier turns)."""

    type: Literal["reasoning"]


def _item_tag(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "message"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_item_tag)]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Name
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class OtherTool(_Strict):
    """A hosted tool (web_search, file_search, mcp, ...): refused with its type named."""

    type: Annotated[str, Field(max_length=64)]


Tool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[OtherTool, Tag("other")]],
                 Discriminator(lambda v: "function" if (v.get("type") if isinstance(v, dict) else v.type) == "function"
                               else "other")]


class NamedToolChoice(_Strict):
    type: Literal["function"]
    name: Name


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[Name] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class TextConfig(_Strict):
    format: Optional[TextFormat] = None


class ReasoningConfig(_Strict):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[str] = None


class ResponsesRequest(_Strict):
    model: Optional[str] = None
    input: Union[Annotated[str, Field(min_length=1)], Annotated[list[InputItem], Field(min_length=1, max_length=4096)]]
    instructions: Optional[str] = None
    previous_response_id: Optional[Annotated[str, Field(min_length=1, max_length=256)]] = None
    tools: Optional[Annotated[list[Tool], Field(max_length=1024)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    max_output_tokens: Optional[int] = Field(None, ge=1, le=_INT32)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    stream: bool = False
    store: bool = True
    background: bool = False
    truncation: Literal["disabled", "auto"] = "disabled"
    metadata: Optional[Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)]] = None
    user: Optional[str] = Field(None, max_length=1024)
    # vLLM's extra sampling fields
    top_k: Optional[int] = Field(None, ge=-1, le=_INT32)
    seed: Optional[int] = Field(None, ge=-_INT64 - 1, le=_INT64)
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=256)
