"""Structured outputs over HTTP on the default model (one `vpage serve` for the module), with
the official openai client: `chat.completions.parse` with a pydantic model, 20+ JSON schemas
validated by jsonschema (whole and streamed, sent together so the server batches them),
regex, choice, an EBNF grammar, json_object, vLLM's guided_* fields, the completions
endpoint, llguidance (a Lark grammar and schemas, in-process) and bad input (each a 400, the
server unchanged)."""

from __future__ import annotations

import gc
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from live_server import LiveServer

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

MODEL = "smollm2"
_STR = {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}  # ASCII: one character, at most one token
_DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}


def _obj(properties: dict, required: list | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False}


# (name, schema, max_tokens): every schema bounds its arrays and (but for email and number)
# its strings and numbers, so a valid answer fits in max_tokens whatever the model picks (a
# character outside ASCII may take up to 4 tokens).
SCHEMAS = [
    ("flat", _obj({"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}}), 40),
    ("nested", _obj({"person": _obj({"name": _STR, "address": _obj({"city": _STR,
                                                                   "zip": {"type": "string",
                                                                           "pattern": "^[0-9]{5}$"}})})}), 70),
    ("array_bounds", _obj({"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                    "minItems": 2, "maxItems": 4}}), 60),
    ("enum", _obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string",
                                                                         "enum": ["S", "M", "L"]}}), 30),
    ("any_of", _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100},
                                         {"type": "string", "maxLength": 4}]}}), 30),
    ("optional", _obj({"id": _DIGIT, "note": _STR, "flag": {"type": "boolean"}}, required=["id"]), 50),
    ("pattern", _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}), 30),
    ("date", _obj({"day": {"type": "string", "format": "date"}}), 30),
    ("email", _obj({"email": {"type": "string", "format": "email"}}), 60),
    ("uuid", _obj({"id": {"type": "string", "format": "uuid"}}), 60),
    ("ipv4", _obj({"host": {"type": "string", "format": "ipv4"}}), 30),
    ("integer_bounds", _obj({"low": {"type": "integer", "minimum": -50, "maximum": -10},
                             "high": {"type": "integer", "exclusiveMinimum": 1000, "maximum": 1005}}), 30),
    ("number_bounds", _obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}}), 40),
    ("const", _obj({"version": {"const": 2}, "kind": {"const": "point"}}), 30),
    ("booleans", _obj({"active": {"type": "boolean"}, "admin": {"type": "boolean"}}), 30),
    ("nulls", _obj({"deleted": {"type": "null"}, "parent": {"type": ["string", "null"], "maxLength": 6}}), 50),
    ("array_of_objects", _obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                         "items": _obj({"id": _DIGIT, "ok": {"type": "boolean"}})}}), 80),
    ("top_level_array", {"type": "array", "items": _DIGIT, "minItems": 3, "maxItems": 3}, 20),
    ("top_level_enum", {"enum": ["yes", "no", "maybe"]}, 10),
    ("refs", {"$defs": {"point": _obj({"x": _DIGIT, "y": _DIGIT})}, **_obj({"a": {"$ref": "#/$defs/point"},
                                                                         "b": {"$ref": "#/$defs/point"}})}, 60),
    ("tuple", {"type": "array", "prefixItems": [_STR, _DIGIT, {"type": "boolean"}], "items": False,
               "minItems": 3}, 30),
    ("string_lengths", _obj({"word": {"type": "string", "minLength": 3, "maxLength": 6}}), 40),
    ("matrix", _obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                              "items": {"type": "array", "items": _DIGIT, "minItems": 2, "maxItems": 2}}}), 40),
]
_BY_NAME = {name: schema for name, schema, _ in SCHEMAS}
# 24 schemas a user might send (objects, enums, nested objects, arrays, patterns), each with a
# question: with vpage's defaults (strict JSON, bounded whitespace) every answer must end.
ENDING = json.loads((Path(__file__).parents[1] / "structured_output" / "schemas_that_end.json").read_text())


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("--dtype", "float32", "--kv-cache-memory", "0.5", "--max-model-len", "1024",
                     "--max-num-seqs", "64", "--max-num-batched-tokens", "2048")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _messages(task: str) -> list[dict]:
    return [{"role": "user", "content": task}]


def _schema_messages(schema: dict) -> list[dict]:
    return _messages(f"Reply with a JSON value matching this schema: {json.dumps(schema)}")


def _validate(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def _chat(client, schema: dict, max_tokens: int, stream: bool) -> tuple[str, str]:
    """(text, finish reason) of a greedy chat answer under ``schema`` as response_format."""
    # disable_any_whitespace keeps these answers compact, within their token budgets (the
    # default bounds whitespace instead: test_schemas_end_with_valid_json_by_default).
    kwargs = dict(model=MODEL, messages=_schema_messages(schema), max_tokens=max_tokens, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                          "strict": True}},
                  extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def test_parse_with_a_pydantic_model_returns_an_instance(client):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=16)
        country: str = pydantic.Field(max_length=16)
        population_millions: int = pydantic.Field(ge=0, le=50)
        coastal: bool

    completion = client.chat.completions.parse(model=MODEL, messages=_messages("Describe Paris as JSON."),
                                               response_format=City, max_tokens=80, temperature=0)
    message = completion.choices[0].message
    assert isinstance(message.parsed, City)
    assert message.parsed == City.model_validate_json(message.content)


def _ending_failures(answers: list[tuple[str, str, int]]) -> list[str]:
    failures = []
    for case, (text, reason, tokens) in zip(ENDING, answers):
        try:
            assert reason == "stop" and tokens <= 150, f"finish_reason {reason} after {tokens} tokens"
            _validate(text, case["schema"])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{case['ask']}: {text!r}: {str(exc)[:200]}")
    return failures


def test_schemas_end_with_valid_json_by_default(client):
    # As a new user asks through the official client: OpenAI's json_schema response_format, no
    # vpage options, greedy, 150 tokens at most (the default backend, xgrammar).
    def ask(case: dict) -> tuple[str, str, int]:
        completion = client.chat.completions.create(
            model=MODEL, messages=_messages(case["ask"] + " Answer in JSON."), max_tokens=150, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": case["schema"],
                                                                    "strict": True}})
        return completion.choices[0].message.content, completion.choices[0].finish_reason, \
            completion.usage.completion_tokens

    with ThreadPoolExecutor(len(ENDING)) as pool:
        failures = _ending_failures(list(pool.map(ask, ENDING)))
    assert not failures, "\n".join(failures)


def test_schemas_end_with_valid_json_by_default_llguidance():
    from vpage import LLM, SamplingParams
    from vpage.sampling_params import StructuredOutputsParams

    llm = LLM(structured_outputs_backend="llguidance", kv_cache_memory=0.5, max_model_len=1024)
    try:
        outputs = llm.chat([_messages(case["ask"] + " Answer in JSON.") for case in ENDING],
                           [SamplingParams(temperature=0, max_tokens=150,
                                           structured_outputs=StructuredOutputsParams(json=case["schema"]))
                            for case in ENDING], use_tqdm=False)
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()  # the model and its KV cache go now, not at some later test's collection
    answers = [(o.outputs[0].text, o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in outputs]
    failures = _ending_failures(answers)
    assert not failures, "\n".join(failures)


def test_json_schemas_whole_and_streamed_validate(client):
    jobs = [(name, schema, tokens, stream) for name, schema, tokens in SCHEMAS for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: _chat(client, job[1], job[2], job[3]), jobs))
    failures = []
    for (name, schema, _, stream), (text, reason) in zip(jobs, answers):
        try:
            assert reason == "stop", f"finish_reason {reason}"
            _validate(text, schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append(f"{name} (stream={stream}): {text!r}: {str(exc)[:200]}")
    assert not failures, "\n".join(failures)
    # greedy: the streamed deltas add up to the whole answer
    assert [a for a, job in zip(answers, jobs) if job[3]] == [a for a, job in zip(answers, jobs) if not job[3]]


def test_regex_choice_grammar_and_json_object(client):
    def chat(task: str, max_tokens: int, **extra) -> str:
        choice = client.chat.completions.create(model=MODEL, messages=_messages(task), max_tokens=max_tokens,
                                                temperature=0, **extra).choices[0]
        assert choice.finish_reason == "stop"
        return choice.message.content

    grammar = ('root ::= "SELECT " column " FROM " table " WHERE " column " = " digit\n'
               'column ::= "name" | "age" | "city"\ntable ::= "users" | "orders"\ndigit ::= [0-9]')
    jobs = {
        "regex": lambda: chat("Give a phone number.", 20,
                              extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}}),
        "guided_regex": lambda: chat("Give a phone number.", 20, extra_body={"guided_regex": r"\d{3}-\d{4}"}),
        "choice": lambda: chat("What is the capital of France?", 10,
                               extra_body={"structured_outputs": {"choice": ["Paris", "London", "Berlin"]}}),
        "guided_choice": lambda: chat("Is the sky blue?", 10, extra_body={"guided_choice": ["yes", "no"]}),
        "grammar": lambda: chat("Write an SQL query for the users named 3.", 30,
                                extra_body={"structured_outputs": {"grammar": grammar}}),
        "guided_grammar": lambda: chat("Write an SQL query.", 30, extra_body={"guided_grammar": grammar}),
        # json_object bounds nothing: a prompt the model can copy keeps the object short
        "json_object": lambda: chat('Reply with the JSON object {"animal": "cat", "legs": 4}.', 60,
                                    response_format={"type": "json_object"}),
        "guided_json": lambda: chat("Give a person as JSON.", 60, extra_body={"guided_json": _BY_NAME["flat"]}),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = dict(zip(jobs, pool.map(lambda job: job(), jobs.values())))
    assert re.fullmatch(r"\d{3}-\d{4}", got["regex"]) and re.fullmatch(r"\d{3}-\d{4}", got["guided_regex"])
    assert got["choice"] in ("Paris", "London", "Berlin") and got["guided_choice"] in ("yes", "no")
    sql = r"SELECT (name|age|city) FROM (users|orders) WHERE (name|age|city) = [0-9]"
    assert re.fullmatch(sql, got["grammar"]) and re.fullmatch(sql, got["guided_grammar"])
    assert isinstance(json.loads(got["json_object"]), dict)
    _validate(got["guided_json"], _BY_NAME["flat"])


def test_completions_endpoint(client):
    schema = SCHEMAS[0][1]
    prompt = f"A JSON value matching {json.dumps(schema)}:"
    whole = client.completions.create(model=MODEL, prompt=[prompt, "The person, as JSON:"], max_tokens=40,
                                      temperature=0, extra_body={"response_format": {
                                          "type": "json_schema", "json_schema": {"name": "p", "schema": schema}}})
    assert len(whole.choices) == 2
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        _validate(choice.text, schema)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stream=True,
        extra_body={"structured_outputs": {"json": schema}}))
    assert streamed == sorted(whole.choices, key=lambda c: c.index)[0].text
    choice = client.completions.create(model=MODEL, prompt="The best pet is a", max_tokens=5, temperature=0,
                                       extra_body={"guided_choice": [" cat", " dog"]}).choices[0]
    assert choice.text in (" cat", " dog")


_POINT = {"type": "object", "properties": {"x": _DIGIT}, "required": ["x"]}
BAD = [
    # (body fields, the field or a word the message names)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "objekt"),
    ({"structured_outputs": {"regex": "a(b"}}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "undefined_rule"),
    ({"structured_outputs": {"json": "{not json"}}, "json"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}, "structured_outputs.regex"),
    ({"guided_json": _POINT, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"json": _POINT, "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"use_beam_search": True, "n": 2, "temperature": 0, "guided_choice": ["a", "b"]}, "beam"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_bad_constraints_are_400_and_the_server_keeps_serving(server, stream):
    reference = {"messages": _messages("Is water wet?"), "max_tokens": 3, "temperature": 0,
                 "structured_outputs": {"choice": ["yes", "no"]}}
    status, before = server.request("POST", "/v1/chat/completions", reference)
    assert status == 200
    for fields, needle in BAD:
        if stream and fields.get("use_beam_search"):
            continue  # streaming refuses beam search by itself
        body = {"messages": _messages("Hello"), "max_tokens": 5, "stream": stream, **fields}
        status, payload = server.request("POST", "/v1/chat/completions", body)
        assert status == 400, (fields, payload)
        error = payload["error"]
        assert error["code"] == 400 and needle in error["message"] + str(error["param"]), (fields, payload)
        assert "Traceback" not in error["message"]
    status, after = server.request("POST", "/v1/chat/completions", reference)
    assert status == 200 and after["choices"] == before["choices"]
    server.wait_idle()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from model_fixtures import save_tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", folder)
    return str(folder)


def test_llguidance_lark_grammar_regex_and_schemas_in_process(tiny_model):
    # llguidance in-process (a second server, or the default model in-process, costs ~10 s of
    # start-up): a tiny random model (its byte-level tokenizer spells anything), where only the
    # grammar decides what comes out; each constraint bounds its output.
    from vpage import LLM, SamplingParams
    from vpage.sampling_params import StructuredOutputsParams as SO

    lark = 'start: "SELECT " COLUMN " FROM " TABLE\nCOLUMN: "name" | "age"\nTABLE: "users" | "orders"'
    names = ["nested", "array_of_objects", "enum", "any_of", "date", "uuid", "refs", "tuple", "matrix"]
    constraints = [SO(grammar=lark), SO(regex=r"[a-z]{2,5}@[a-z]{2,5}\.org")]
    constraints += [SO(json=_BY_NAME[n], disable_any_whitespace=True) for n in names]
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=so) for so in constraints]
    with LLM(tiny_model, dtype="float32", device="cpu", kv_cache_memory=0.02, max_model_len=256,
             structured_outputs_backend="llguidance") as llm:
        outputs = [o.outputs[0] for o in llm.generate([[5, 6, 7]] * len(params), params, use_tqdm=False)]
        with pytest.raises(ValueError, match="undefined"):
            llm.generate([5, 6], SamplingParams(max_tokens=2, structured_outputs=SO(grammar='start: "a" undefined')),
                         use_tqdm=False)
    assert all(o.finish_reason == "stop" for o in outputs), [(o.text, o.finish_reason) for o in outputs]
    assert re.fullmatch(r"SELECT (name|age) FROM (users|orders)", outputs[0].text)
    assert re.fullmatch(r"[a-z]{2,5}@[a-z]{2,5}\.org", outputs[1].text)
    for name, out in zip(names, outputs[2:]):
        _validate(out.text, _BY_NAME[name])
