"""Tool-call parsers (hermes, llama3_json, mistral, pythonic, and the readers of "required"
and named tool_choice outputs): whole outputs to (content, tool_calls), and the same outputs
streamed in random 1-3 character deltas, whose content and per-call argument pieces must add
up to the whole answer (arguments byte for byte, and equal to the expected JSON); text that is
not a tool call stays content; the tool_choice schemas accept and refuse what they should."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from vpage.entrypoints.openai.protocol import ChatCompletionRequest
from vpage.entrypoints.openai.tool_choice import (NamedToolParser, RequiredToolParser, resolve_tool_choice,
                                                  tool_choice_schema)
from vpage.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names

WEATHER = {"city": "Paris", "days": 3, "units": "metric"}
NESTED = {"query": "a } ] \" </tool_call> ; [TOOL_CALLS] (x)", "filters": {"tags": ["x", "y"], "max": 2.5e-3},
          "flag": False, "none": None, "text": "café ☕"}

# (parser, output, content, [(name, arguments)])
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + '}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me look.\n<tool_call>{"arguments": ' + json.dumps(NESTED, ensure_ascii=False)
     + ', "name": "search"}</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     "Let me look.", [("search", NESTED), ("now", {})]),
    ("hermes", '<tool_call>\n{"name": "now"}', None, [("now", {})]),  # stopped before </tool_call>
    ("hermes", '<tool_call>{"name": "enc", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>', None,
     [("enc", {"a": [1, 2]})]),  # arguments sent as a JSON string
    ("hermes", "No tools needed < here >, thanks.\n", "No tools needed < here >, thanks.\n", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}",
     None, [("get_weather", WEATHER)]),
    ("llama3_json", ' {"name": "search", "parameters": ' + json.dumps(NESTED) + '}; {"name": "now", "arguments": {}}',
     None, [("search", NESTED), ("now", {})]),
    ("llama3_json", "The answer is {not json}.", "The answer is {not json}.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}]",
     None, [("get_weather", WEATHER)]),
    ("mistral", 'Checking. [TOOL_CALLS] [{"name": "search", "arguments": ' + json.dumps(NESTED)
     + '},{"name":"now","arguments":{}}]', "Checking.", [("search", NESTED), ("now", {})]),
    ("mistral", "Plain [TOOL answer.", "Plain [TOOL answer.", []),
    ("pythonic", '[get_weather(city="Paris", days=3, units=\'metric\')]', None, [("get_weather", WEATHER)]),
    ("pythonic", '[search(query="a } ] \\" </tool_call> ; [TOOL_CALLS] (x)", filters={"tags": ("x", "y"), '
     '"max": 2.5e-3}, flag=False, none=None, text="café ☕"), now()]', None, [("search", NESTED), ("now", {})]),
    ("pythonic", "[1, 2] is a list.", "[1, 2] is a list.", []),
    ("pythonic", "Sure: [f(x=1)]", "Sure: [f(x=1)]", []),
]


def _stream(parser, text: str, seed: int) -> tuple[str, dict[int, dict]]:
    """Feeds ``text`` in random 1-3 character deltas; returns the content and, per call index,
    its id, name and concatenated arguments (checking the shape of every delta)."""
    rng = random.Random(seed)
    content, calls, previous, i = "", {}, "", 0
    while i < len(text):
        piece = text[i:i + rng.randint(1, 3)]
        i += len(piece)
        delta_content, deltas = parser.extract_tool_calls_streaming(previous, piece, final=i >= len(text))
        previous += piece
        content += delta_content
        for d in deltas:
            if d["index"] not in calls:
                assert d["index"] == len(calls) and d["type"] == "function" and d["function"]["name"]
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"],
                                     "arguments": d["function"]["arguments"]}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                assert d["function"]["arguments"]
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, calls


def _check_id(name: str, call_id: str) -> None:
    pattern = r"[A-Za-z0-9]{9}" if name == "mistral" else r"chatcmpl-tool-[0-9a-f]{32}"
    assert re.fullmatch(pattern, call_id), call_id


def test_registered():
    assert tool_parser_names() == ["hermes", "llama3_json", "mistral", "pythonic"]
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name,output,content,expected", CASES)
def test_whole_and_streamed(name, output, content, expected):
    got_content, calls = get_tool_parser(name)(None).extract_tool_calls(output)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    for c in calls:
        _check_id(name, c["id"])
        assert c["type"] == "function"
    for seed in range(5):
        streamed_content, streamed = _stream(get_tool_parser(name)(None), output, seed)
        assert streamed_content == (content or "")
        assert [(s["name"], s["arguments"]) for s in streamed.values()] == \
               [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        for s in streamed.values():
            _check_id(name, s["id"])


@pytest.mark.parametrize("name,output", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}'),  # cut off inside the JSON
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}} trailing</tool_call>'),
    ("hermes", '<tool_call>["f"]</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and more'),
    ("llama3_json", '{"parameters": {}}'),  # no name
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": NaN}}]'),
    ("pythonic", "[f(1, 2)]"),  # positional arguments
    ("pythonic", "[f(a=open('x'))]"),  # not a literal
    ("pythonic", "[f(a=1)] extra"),
])
def test_malformed_output_is_content(name, output):
    assert get_tool_parser(name)(None).extract_tool_calls(output) == (output, [])


def test_streamed_text_that_is_not_a_call_after_all():
    # The stream holds "[" back while it may begin a pythonic call list, then sends it as content.
    content, calls = _stream(get_tool_parser("pythonic")(None), "[1, 2] is a list.", 0)
    assert (content, calls) == ("[1, 2] is a list.", {})
    content, calls = _stream(get_tool_parser("llama3_json")(None), "<|python_start|> hi", 1)
    assert (content, calls) == ("<|python_start|> hi", {})


def test_named_and_required_readers():
    args = json.dumps(NESTED)
    content, calls = NamedToolParser(None, "search").extract_tool_calls(" " + args + "\n")
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("search", args)]
    streamed_content, streamed = _stream(NamedToolParser(None, "search"), " " + args + "\n", 3)
    assert streamed_content == "" and [(s["name"], s["arguments"]) for s in streamed.values()] == [("search", args)]
    required = json.dumps([{"name": "get_weather", "parameters": WEATHER}, {"name": "now", "parameters": {}}])
    content, calls = RequiredToolParser(None).extract_tool_calls(required)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", WEATHER), ("now", {})]
    for seed in range(3):
        _, streamed = _stream(RequiredToolParser(None), required, seed)
        assert [(s["name"], s["arguments"]) for s in streamed.values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert RequiredToolParser(None).extract_tool_calls('{"name": "now"}') == ('{"name": "now"}', [])


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "loc": {"$ref": "#/$defs/loc"}},
        "required": ["city"], "$defs": {"loc": {"type": "array", "items": {"type": "number"}}}}}},
    {"type": "function", "function": {"name": "now"}},
]


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_tool_choice_schemas():
    req = _request(tools=TOOLS, tool_choice="required")
    schema = tool_choice_schema(req, resolve_tool_choice(req))
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Rome", "loc": [1.5, 2]}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {"loc": []}}],
                [{"name": "get_weather", "parameters": {"city": "x", "loc": ["a"]}}],
                [{"name": "now", "parameters": {}, "extra": 1}], [{"name": "now"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = _request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, tool_choice_schema(single, "required"))
    named = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert tool_choice_schema(named, resolve_tool_choice(named)) == {"type": "object", "properties": {}}
    assert tool_choice_schema(_request(tools=TOOLS), "auto") is None
    assert resolve_tool_choice(_request(tools=TOOLS)) == "auto"
    assert resolve_tool_choice(_request()) == "none"
