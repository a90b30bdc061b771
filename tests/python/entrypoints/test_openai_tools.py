"""Tool calling and reasoning over HTTP with the official openai client: one `vpage serve` of
the default model with a Hermes-style chat template (hermes_tool_template.jinja), --enable-auto-
tool-choice --tool-call-parser hermes --reasoning-parser qwen3.

- ``required`` and named tool_choice are constrained by the tools' JSON schemas, so their
  arguments validate against the tool's schema whatever the model; the streamed deltas add up
  to the same calls as the whole answer (greedy); the assistant tool_calls message and a tool
  message with its tool_call_id go back and get an answer.
- ``auto`` is the model's own choice: the conversation shows it two earlier weather questions
  answered with get_weather calls, and under greedy decoding the default model then calls
  get_weather for Rome itself (checked output); the hermes parser reads it from real tokens.
- reasoning: the template opens a <think> block when chat_template_kwargs has enable_thinking
  true; with one worked example in the conversation the model closes the block and answers, so
  reasoning_content and content split at its </think> (also streamed); with thinking off the
  prompt holds an empty block and all is content.
- the conversation reaches the template as Hugging Face templates expect it (tool call
  arguments as objects, the tool result after the call, the tools, chat_template_kwargs).
- 400s (missing named tool, auto without the flag, tool_choice without tools, an untrusted
  request template, reserved chat_template_kwargs) leave the server serving; an unknown
  --tool-call-parser makes `vpage serve` exit non-zero naming the choices.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from live_server import TOOL_TEMPLATE, tool_server

TEMPLATE = Path(TOOL_TEMPLATE)
WEATHER_PARAMETERS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "description": "Get the time in a time zone",
                                           "parameters": TIME_PARAMETERS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server():
    srv = tool_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _create(client, max_tokens: int = 48, **kwargs):
    return client.chat.completions.create(model="smollm2", temperature=0, max_tokens=max_tokens, **kwargs)


def _streamed(client, **kwargs):
    """(content, reasoning_content, [(id, name, arguments)], finish_reason) of a streamed answer,
    checking each tool-call delta's shape: the first of a call has index, id, type and name."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in _create(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for d in delta.tool_calls or []:
            if d.index not in calls:
                assert d.index == len(calls) and d.type == "function" and d.id.startswith("chatcmpl-tool-")
                calls[d.index] = [d.id, d.function.name, d.function.arguments or ""]
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][2] += d.function.arguments
        finish = choice.finish_reason or finish
    return content, reasoning, [tuple(c) for c in calls.values()], finish


def _valid_calls(message) -> list[tuple[str, dict]]:
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    return calls


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_call_round_trip(client, tool_choice):
    whole = _create(client, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = _valid_calls(choice.message)
    assert len(calls) == 1 and (tool_choice == "required" or calls[0][0] == "get_weather")
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    content, _, streamed, finish = _streamed(client, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                             parallel_tool_calls=False)
    assert (content, finish) == ("", "tool_calls")
    assert [(name, args) for _, name, args in streamed] == [(call.function.name, call.function.arguments)]
    # The call and its result go back (arguments as the JSON text the server sent); the model answers.
    history = QUESTION + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    answer = _create(client, max_tokens=12, messages=history, tools=TOOLS, tool_choice="none")
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > whole.usage.prompt_tokens + 20


def _call(city: str, i: int) -> list[dict]:
    return [{"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": '{"temperature": 21}'}]


AUTO = ([{"role": "user", "content": "Weather in Paris?"}] + _call("Paris", 1)
        + [{"role": "assistant", "content": "It is 21 degrees in Paris."},
           {"role": "user", "content": "Weather in Berlin?"}] + _call("Berlin", 2)
        + [{"role": "assistant", "content": "It is 21 degrees in Berlin."},
           {"role": "user", "content": "Weather in Rome?"}])


def test_auto_tool_choice(client):
    whole = _create(client, messages=AUTO, tools=TOOLS)  # tools without tool_choice: "auto"
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _valid_calls(choice.message) == [("get_weather", {"city": "Rome", "unit": "celsius"})]
    content, _, streamed, finish = _streamed(client, messages=AUTO, tools=TOOLS, tool_choice="auto")
    assert (content, finish) == ("", "tool_calls")
    call = choice.message.tool_calls[0]
    assert [(name, args) for _, name, args in streamed] == [(call.function.name, call.function.arguments)]
    # tool_choice "none": the same output is plain content.
    none = _create(client, messages=AUTO, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.tool_calls is None and "<tool_call>" in none.choices[0].message.content


THINK = [{"role": "system", "content": "Think first inside <think> tags, then answer."},
         {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "<think>\nI add 2 and 2.\n</think>\n4"},
         {"role": "user", "content": "What is 3+3?"}]


def test_reasoning_split(client):
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    whole = _create(client, messages=THINK, extra_body=thinking)
    message = whole.choices[0].message
    assert message.reasoning_content == "I add 3 and 3.\n" and message.content.strip()
    assert "</think>" not in message.content and whole.choices[0].finish_reason == "stop"
    content, reasoning, calls, finish = _streamed(client, messages=THINK, extra_body=thinking)
    assert (content, reasoning, calls, finish) == (message.content, message.reasoning_content, [], "stop")
    hidden = _create(client, messages=THINK, extra_body={**thinking, "include_reasoning": False})
    assert hidden.choices[0].message.reasoning_content is None and hidden.choices[0].message.content == message.content
    off = _create(client, max_tokens=8, messages=THINK).choices[0].message  # empty <think></think> in the prompt
    assert off.reasoning_content is None and off.content


BAD_REQUESTS = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}},
     "Tool 'get_stock' has not been passed in `tools`."),
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set."),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}, "tool_choice"),
    ({"chat_template": "{{ messages }}"}, "--trust-request-chat-template"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs may not set tokenize"),
    ({"functions": [{"name": "f"}]}, "'functions' is not supported"),
]


def test_bad_tool_requests(server, client):
    for body, message in BAD_REQUESTS:
        status, answer = server.request("POST", "/v1/chat/completions",
                                        {"model": "smollm2", "messages": QUESTION, "max_tokens": 4, **body})
        assert status == 400 and message in answer["error"]["message"], answer
    assert _create(client, messages=QUESTION, max_tokens=2).choices[0].finish_reason == "length"


class _RenderingTokenizer:
    """apply_chat_template renders with transformers' Jinja (as a tokenizer does) and returns
    the code points of the text."""

    def apply_chat_template(self, conversation, tools=None, chat_template=None, add_generation_prompt=False,
                            tokenize=True, return_dict=False, **kwargs):
        from transformers.utils.chat_template_utils import render_jinja_template

        assert tokenize and not return_dict
        rendered, _ = render_jinja_template([conversation], tools=tools, chat_template=chat_template,
                                            add_generation_prompt=add_generation_prompt, **kwargs)
        return [ord(c) for c in rendered[0]]


def test_conversation_reaches_the_template():
    from vpage.entrypoints.openai.chat_utils import ChatOptions, ChatServing, load_chat_template
    from vpage.entrypoints.openai.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({
        "messages": QUESTION + _call("Paris", 7), "tools": TOOLS, "tool_choice": "none",
        "chat_template_kwargs": {"enable_thinking": True}})
    serving = ChatServing(ChatOptions(chat_template=load_chat_template(str(TEMPLATE))))
    prompt = "".join(map(chr, serving.prepare(_RenderingTokenizer(), req).prompt_token_ids))
    assert json.dumps(TOOLS[1]) in prompt  # the tools, in the system prompt
    # The call's JSON-text arguments reach the template as an object; the result follows it.
    assert prompt.endswith('<|im_start|>assistant\n<think>\n</think>\n<tool_call>\n{"name": "get_weather", '
                           '"arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>\n'
                           '<|im_start|>tool\n{"temperature": 21}<|im_end|>\n<|im_start|>assistant\n<think>\n')


def test_tool_choice_constraint_is_the_only_one():
    from vpage.entrypoints.openai.chat_utils import PreparedChat
    from vpage.entrypoints.openai.protocol import ApiError
    from vpage.sampling_params import StructuredOutputsParams

    prepared = PreparedChat([1], {"structured_outputs": StructuredOutputsParams(json=WEATHER_PARAMETERS)})
    kwargs = {"temperature": 0.0}
    prepared.update_sampling(kwargs)
    assert kwargs["structured_outputs"].json == WEATHER_PARAMETERS
    with pytest.raises(ApiError) as err:
        prepared.update_sampling({"structured_outputs": StructuredOutputsParams(regex="a+")})
    assert err.value.status == 400 and err.value.param == "tool_choice"


def test_auto_needs_the_flag():
    from vpage.entrypoints.openai.chat_utils import ChatOptions, ChatServing
    from vpage.entrypoints.openai.protocol import ApiError, ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": QUESTION, "tools": TOOLS, "tool_choice": "auto"})
    with pytest.raises(ApiError) as err:
        ChatServing(ChatOptions(tool_call_parser="hermes")).prepare(None, req)
    assert err.value.status == 400 and "--enable-auto-tool-choice" in str(err.value)


def test_unknown_parser_fails_at_start(capsys):
    done = subprocess.run([sys.executable, "-m", "vpage.cli", "serve", "--port", "0", "--enable-auto-tool-choice",
                           "--tool-call-parser", "nope"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "invalid tool call parser: 'nope' (choose from hermes, llama3_json, mistral, pythonic)" in done.stderr
    from vpage.cli import main

    # The same checks in-process (they run before the engine starts).
    for flags, message in [(["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
                           (["--reasoning-parser", "nope"], "unknown reasoning parser 'nope'; choose one of"),
                           (["--chat-template", str(TEMPLATE) + ".missing"], "--chat-template: no such file")]:
        assert main(["serve", "--port", "0", *flags]) == 2
        assert message in capsys.readouterr().err
