"""OpenAI API request bodies as strict pydantic models, and OpenAI's error shape.

Field names follow OpenAI's completions and chat completions APIs, plus vLLM's extra
sampling fields (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids,
skip_special_tokens, include_stop_str_in_output, use_beam_search, length_penalty,
early_stopping, cache_salt). Types are strict (``"false"`` is not a bool, ``"1"`` not an
int) and every number has a range, so nothing a request carries can make the engine raise.
Checks that need the engine (context length, vocabulary, ``max_num_seqs``) are in
``serving.py``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vpage.entrypoints.openai.structured_outputs import (Choices, JsonSchema, NonEmpty, ResponseFormat,
                                                         StructuredOutputsRequest)

MAX_TOP_LOGPROBS = 20
_INT32 = 2**31 - 1
_INT64 = 2**63 - 1

Int32 = Annotated[int, Field(ge=-_INT32 - 1, le=_INT32)]
TokenId = Annotated[int, Field(ge=0, le=_INT32)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
StopString = Annotated[str, Field(min_length=1, max_length=1024)]


class ApiError(Exception):
    """An error answered with an HTTP status and OpenAI's error body (never a traceback)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


class _Strict(BaseModel):
    # Unknown fields are ignored (OpenAI clients send fields vpage has no use for).
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: Optional[bool] = True  # vLLM's default: stream_options alone asks for usage
    continuous_usage_stats: Optional[bool] = False  # usage in every chunk (with include_usage)


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=_INT32)
    best_of: Optional[int] = Field(None, ge=1, le=_INT32)
    temperature: Optional[float] = Field(None, ge=0.0, le=1e4)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1, le=_INT32)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=2.0)
    seed: Optional[int] = Field(None, ge=-_INT64 - 1, le=_INT64)
    stop: Union[StopString, list[StopString], None] = Field(None, max_length=64)
    stop_token_ids: Optional[list[TokenId]] = Field(None, max_length=256)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_INT32)
    max_tokens: Optional[int] = Field(None, ge=0, le=_INT32)  # 0: completions with echo (prompt_logprobs.py)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-1e3, le=1e3)
    early_stopping: Union[bool, Literal["never"]] = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = Field(None, max_length=1024)
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=256)
    # Token id (as a JSON key) -> bias added to its logit, clamped to [-100, 100] as OpenAI does.
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[Annotated[list[TokenId], Field(min_length=1)]] = None
    bad_words: Optional[list[StopString]] = Field(None, max_length=256)
    prompt_logprobs: Optional[Int32] = None  # vLLM's; checked in prompt_logprobs.py
    # structured outputs (structured_outputs.py): at most one constraint
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    guided_json: Optional[JsonSchema] = None
    guided_regex: Optional[NonEmpty] = None
    guided_choice: Optional[Choices] = None
    guided_grammar: Optional[NonEmpty] = None
    guided_whitespace_pattern: Optional[NonEmpty] = None
    # OpenAI fields vpage does not implement: refused when given a non-empty value.
    functions: Optional[Any] = None
    suffix: Optional[Any] = None

    def unsupported(self) -> Optional[str]:
        for name in ("functions", "suffix"):
            if getattr(self, name) not in (None, {}, [], ""):
                return name
        return None


PromptIds = Annotated[list[Int32], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    prompt: Union[Annotated[str, Field(min_length=1)], Annotated[list[Annotated[str, Field(min_length=1)]],
                  Field(min_length=1, max_length=256)], PromptIds,
                  Annotated[list[PromptIds], Field(min_length=1, max_length=256)]]
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def prompt_list(self) -> list:
        """The prompts as a list of strings or token id lists."""
        p = self.prompt
        return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


ToolName = Annotated[str, Field(min_length=1, max_length=256)]


class FunctionDefinition(_Strict):
    name: ToolName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments
    strict: Optional[bool] = None


class ChatCompletionToolsParam(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Strict):
    name: ToolName


class ChatCompletionNamedToolChoiceParam(_Strict):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(_Strict):
    name: ToolName
    arguments: Union[str, dict[str, Any]]  # JSON text (OpenAI's), or the object itself


class ToolCall(_Strict):
    id: Optional[str] = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """A message of the conversation: an assistant's may carry ``tool_calls`` (and no content),
    a ``tool`` message answers one of them by ``tool_call_id``."""

    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = Field(None, max_length=256)
    tool_calls: Optional[list[ToolCall]] = Field(None, max_length=1024)
    tool_call_id: Optional[str] = Field(None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=_INT32)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # tools (tool_choice.py, chat_utils.py); reasoning_content is left out with include_reasoning false
    tools: Optional[Annotated[list[ChatCompletionToolsParam], Field(max_length=1024)]] = None
    tool_choice: Union[Literal["none", "auto", "required"], ChatCompletionNamedToolChoiceParam, None] = None
    parallel_tool_calls: Optional[bool] = True
    chat_template: Optional[str] = Field(None, max_length=1 << 20)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    include_reasoning: bool = True


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "constrained-str", "literal"}


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} overflows a double")
    return value


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """Parses a JSON body into ``model``; ApiError(400) names the first bad field. Rejects
    invalid UTF-8, lone surrogates, NaN/Infinity, nesting too deep for the parser and
    anything the model's types or ranges refuse."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_finite_float)
        json.dumps(body, ensure_ascii=False).encode("utf-8")  # lone surrogates cannot be encoded
    except (UnicodeError, ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> ApiError:
    """The first of pydantic's errors as an OpenAI 400 naming the field (no input echoed)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = [str(part) for part in first["loc"]]
    # Union members appear in the location ("prompt.list[int]"); keep the field path only.
    field = ".".join(p for p in loc if "[" not in p and p not in _TYPE_NAMES)
    param = loc[0] if loc else None
    return ApiError(400, f"{field or 'body'}: {first['msg']}", param=param)
