"""Anthropic Messages request bodies (strict pydantic models) and Anthropic's error shape."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

_INT32 = 2**31 - 1


class _Strict(BaseModel):
    # Unknown fields are ignored (clients send fields vpage has no use for: metadata, ...).
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ImageBlock(_Strict):
    type: Literal["image"]
    source: dict[str, Any]


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: Union[str, list[TextBlock], None] = None
    is_error: Optional[bool] = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


Block = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock],
                  Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: Union[str, Annotated[list[Block], Field(max_length=4096)]]


class Tool(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: Optional[str] = None
    input_schema: dict[str, Any]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled"]
    budget_tokens: Optional[int] = Field(None, ge=1, le=_INT32)


class MessagesRequest(_Strict):
    model: Optional[str] = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    system: Union[str, list[TextBlock], None] = None
    max_tokens: int = Field(ge=1, le=_INT32)
    stop_sequences: Optional[Annotated[list[str], Field(max_length=16)]] = None
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    stream: bool = False
    tools: Optional[Annotated[list[Tool], Field(max_length=1024)]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None


class CountTokensRequest(_Strict):
    model: Optional[str] = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[Annotated[list[Tool], Field(max_length=1024)]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None


# OpenAI-style error kinds (ApiError.kind) -> Anthropic's error types.
_ERROR_TYPES = {"invalid_request_error": "invalid_request_error", "not_found_error": "not_found_error",
                "authentication_error": "authentication_error", "service_unavailable": "overloaded_error",
                "timeout_error": "api_error", "server_error": "api_error"}


def error_body(status: int, kind: str, message: str) -> dict:
    """Anthropic's error shape for an ApiError of ``kind``."""
    kind = "authentication_error" if status == 401 else ("rate_limit_error" if status == 429 else kind)
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(kind, "api_error"), "message": message}}
