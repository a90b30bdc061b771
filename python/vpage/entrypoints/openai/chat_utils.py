"""Chat requests to engine requests: the conversation in the shape Hugging Face chat templates
expect (assistant ``tool_calls`` with their arguments as objects, ``tool`` messages with their
``tool_call_id``), the tools and ``chat_template_kwargs`` handed to the template, the template
itself (``--chat-template``, or the request's own with ``--trust-request-chat-template``), and
what tools and reasoning need of the sampling parameters and of the answer (``ChatOutput``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from vpage.entrypoints.openai.chat_output import ChatOutput
from vpage.entrypoints.openai.protocol import ApiError, ChatCompletionNamedToolChoiceParam, ChatCompletionRequest
from vpage.entrypoints.openai.tool_choice import (NamedToolParser, RequiredToolParser, resolve_tool_choice,
                                                  tool_choice_schema)
from vpage.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from vpage.reasoning import ReasoningParser, get_reasoning_parser
from vpage.sampling_params import StructuredOutputsParams

# apply_chat_template's own arguments: chat_template_kwargs may not set them.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """``--chat-template``: the text of that file, or the value itself when it is a Jinja
    template; ValueError otherwise."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeError) as exc:
            raise ValueError(f"--chat-template: cannot read {value}: {exc}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: no such file: {value}")


@dataclass
class ChatOptions:
    """The server's chat settings (vLLM's flags)."""

    chat_template: Optional[str] = None  # the template's text (load_chat_template); None: the model's
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    trust_request_chat_template: bool = False

    def validate(self) -> None:
        """ValueError for a flag combination or parser name that cannot work."""
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.tool_call_parser:
            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser:
            get_reasoning_parser(self.reasoning_parser)


def _arguments(arguments):
    """A tool call's arguments as templates expect them: the object, when the JSON text is one."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def conversation(req: ChatCompletionRequest) -> list[dict]:
    """The request's messages as chat-template dicts."""
    messages = []
    for m in req.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type,
                                      "function": {"name": c.function.name,
                                                   "arguments": _arguments(c.function.arguments)}}
                                     for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


@dataclass
class PreparedChat:
    """A chat request ready for the engine: its prompt, what its sampling parameters need, and
    how its answer is read (None: as plain text)."""

    prompt_token_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)
    output: Optional[ChatOutput] = None

    def update_sampling(self, kwargs: dict[str, Any]) -> None:
        """Adds the tool_choice constraint and kept special tokens to SamplingParams kwargs."""
        if self.sampling.get("structured_outputs") is not None and kwargs.get("structured_outputs") is not None:
            raise ApiError(400, "a \"required\" or named tool_choice cannot be combined with another structured "
                                "output constraint", param="tool_choice")
        kwargs.update(self.sampling)


class ChatServing:
    """Builds prompts and answer readers of chat requests under the server's ``ChatOptions``."""

    def __init__(self, options: ChatOptions):
        options.validate()
        self.options = options
        self.tool_parser = get_tool_parser(options.tool_call_parser) if options.enable_auto_tool_choice else None
        self._reasoning_cls = get_reasoning_parser(options.reasoning_parser) if options.reasoning_parser else None
        self._reasoning: Optional[ReasoningParser] = None  # stateless: one for all requests

    def _apply_template(self, tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
        kwargs = dict(req.chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
        template = self.options.chat_template
        if req.chat_template is not None:
            if not self.options.trust_request_chat_template:
                raise ApiError(400, "a chat_template in the request needs the server's --trust-request-chat-template",
                               param="chat_template")
            template = req.chat_template
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            ids = tokenizer.apply_chat_template(conversation(req), tools=tools, chat_template=template,
                                                add_generation_prompt=True, tokenize=True, return_dict=False,
                                                **kwargs)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise ApiError(400, f"the chat template failed on these messages: {str(exc)[:300]}",
                           param="messages") from None
        return list(ids)

    def prepare(self, tokenizer: Any, req: ChatCompletionRequest) -> PreparedChat:
        choice = resolve_tool_choice(req)
        if choice == "auto" and self.tool_parser is None:
            raise ApiError(400, "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser "
                                "to be set", param="tool_choice")
        prepared = PreparedChat(self._apply_template(tokenizer, req))
        schema = tool_choice_schema(req, choice)
        if schema is not None:
            prepared.sampling["structured_outputs"] = StructuredOutputsParams(json=schema)
        make_parser: Optional[Callable[[], ToolParser]] = None
        if isinstance(choice, ChatCompletionNamedToolChoiceParam):
            make_parser = lambda: NamedToolParser(tokenizer, choice.function.name)  # noqa: E731
        elif choice == "required":
            make_parser = lambda: RequiredToolParser(tokenizer)  # noqa: E731
        elif choice == "auto":
            make_parser = lambda: self.tool_parser(tokenizer)  # noqa: E731
            special = set(getattr(tokenizer, "all_special_tokens", ()))
            if any(marker in special for marker in self.tool_parser.markers):
                prepared.sampling["skip_special_tokens"] = False  # the parser must see its tags
        reasoning = self._reasoning_parser(tokenizer)
        if make_parser is not None or reasoning is not None:
            prepared.output = ChatOutput(prepared.prompt_token_ids, reasoning, make_parser, req.include_reasoning,
                                         parallel_tool_calls=req.parallel_tool_calls is not False)
        return prepared

    def _reasoning_parser(self, tokenizer: Any) -> Optional[ReasoningParser]:
        if self._reasoning_cls is not None and self._reasoning is None:
            self._reasoning = self._reasoning_cls(tokenizer)
        return self._reasoning
