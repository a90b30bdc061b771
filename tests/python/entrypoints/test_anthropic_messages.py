"""Anthropic's Messages API through the official `anthropic` client, on the default model with
the Hermes-style tool template (as test_openai_tools.py): a system prompt and text, whole and
streamed (the stream's events add up to the whole answer); a tool round trip (tool_use, then
tool_result, then an answer); stop sequences; thinking blocks from the reasoning parser;
count_tokens; and bad requests answered in Anthropic's error shape with the server serving on."""

from __future__ import annotations

import json

import jsonschema
import pytest

from live_server import tool_server

anthropic = pytest.importorskip("anthropic")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Get the current weather in a city", "input_schema": WEATHER}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "smollm2"


@pytest.fixture(scope="module")
def server():
    srv = tool_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key="unused", max_retries=0,
                               timeout=120)


# Greedy answers, so that whole, streamed and repeated answers agree (this client version takes
# no temperature argument: it goes in the body as an extra field).
GREEDY = {"extra_body": {"temperature": 0}}


def _create(client, **kwargs):
    return client.messages.create(model=MODEL, **{"max_tokens": 24, **GREEDY, **kwargs})


def _streamed(client, **kwargs):
    """The final message of a streamed answer, and the text its text deltas add up to."""
    with client.messages.stream(model=MODEL, **{"max_tokens": 24, **GREEDY, **kwargs}) as stream:
        text = "".join(stream.text_stream)
        return stream.get_final_message(), text


def _whole_and_streamed(client, **kwargs):
    """The whole answer and the streamed one (with the text its deltas add up to), both asked
    after a first ask: a prompt computed afresh and one read from the prefix cache can round a
    near-tie of the quantized default model differently."""
    _create(client, **kwargs)
    return (_create(client, **kwargs), *_streamed(client, **kwargs))


def _shape(message) -> list:
    return [block.model_dump(exclude={"signature"}) for block in message.content]


def test_text_with_a_system_prompt_whole_and_streamed(client):
    kwargs = dict(system="You are a terse assistant.", messages=[{"role": "user", "content": "Name a colour."}])
    whole, streamed, text = _whole_and_streamed(client, **kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.usage.output_tokens > 0
    assert whole.usage.input_tokens == client.messages.count_tokens(model=MODEL, **kwargs).input_tokens
    assert _shape(streamed) == _shape(whole) and text == whole.content[0].text
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert streamed.usage.input_tokens == whole.usage.input_tokens


def test_tool_round_trip(client):
    forced = dict(messages=QUESTION, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=48)
    whole, streamed, text = _whole_and_streamed(client, **forced)
    assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
    call = whole.content[0]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER)
    assert text == "" and streamed.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", call.name, call.input)]
    assert _create(client, **{**forced, "tool_choice": {"type": "any"}}).stop_reason == "tool_use"
    # The call and its result go back; the model answers in text.
    history = QUESTION + [{"role": "assistant", "content": [b.model_dump() for b in whole.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                        "content": json.dumps({"temperature": 21})}]}]
    answer = _create(client, messages=history, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=12)
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text
    assert answer.usage.input_tokens > whole.usage.input_tokens + 10


def test_stop_sequences(client):
    kwargs = dict(messages=[{"role": "user", "content": "Count from one to ten in words."}], max_tokens=40)
    _create(client, **kwargs)
    free = _create(client, **kwargs).content[0].text
    words = free.split()
    assert len(words) > 3, free
    stop = words[2]
    for message in (_create(client, stop_sequences=[stop], **kwargs), _streamed(client, stop_sequences=[stop],
                                                                                **kwargs)[0]):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
        assert stop not in message.content[0].text and free.startswith(message.content[0].text)


def test_thinking_blocks(client):
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "<think>\nI add 2 and 2.\n</think>\n4"},
                {"role": "user", "content": "What is 3+3?"}]
    kwargs = dict(system="Think first inside <think> tags, then answer.", messages=messages,
                  thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=48)
    whole, streamed, _ = _whole_and_streamed(client, **kwargs)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == "I add 3 and 3.\n" and whole.content[1].text.strip()
    assert _shape(streamed) == _shape(whole)


def test_bad_requests_are_anthropic_errors_and_the_server_serves(client, server):
    bad = [dict(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                                         "content": "21"}]}]),
           dict(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                                   "media_type": "image/png",
                                                                                   "data": "AA=="}}]}]),
           dict(messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                tool_choice={"type": "tool", "name": "no_such_tool"}),
           dict(messages=[{"role": "user", "content": "x " * 2000}])]
    for kwargs in bad:
        with pytest.raises(anthropic.BadRequestError) as info:
            _create(client, **kwargs)
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="another-model", max_tokens=4, messages=QUESTION)
    # max_tokens is required (Anthropic's API): a raw request without it is a 400 in Anthropic's shape
    import httpx

    raw = httpx.post(server.base_url + "/messages", json={"model": MODEL, "messages": QUESTION}, timeout=60)
    assert raw.status_code == 400 and raw.json()["type"] == "error"
    assert _create(client, messages=QUESTION).content[0].text
