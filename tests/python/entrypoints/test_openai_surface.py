"""`vpage serve` on the default model: logit_bias, allowed_token_ids and bad_words, stop_reason,
continuous usage in streams, /tokenize and /detokenize against the tokenizer, CORS headers,
API keys on the new routes, and 400s that leave the server as it was."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from live_server import LiveServer

KEY = "surface-key"
ORIGIN = "https://app.example"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"


def _load_tokenizer():
    from vpage.model_executor.loader.default_model import default_model_path
    from vpage.tokenizer import get_tokenizer

    path = default_model_path()
    return get_tokenizer(path.parent, path.name)


@pytest.fixture(scope="module")
def served():
    """The server and, loaded while it starts (both take seconds), the default model's tokenizer."""
    loaded = {}
    thread = threading.Thread(target=lambda: loaded.update(tokenizer=_load_tokenizer()))
    thread.start()
    srv = LiveServer("--dtype", "float32", "--kv-cache-memory", "0.1", "--max-model-len", "512",
                     "--max-num-seqs", "4", "--api-key", KEY, "--allowed-origins", json.dumps([ORIGIN]))
    thread.join()
    yield srv, loaded["tokenizer"]
    srv.stop()


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def tokenizer(served):
    return served[1]


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(server):
    """A greedy answer from before the bad requests."""
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    status, answer = server.request("POST", "/v1/completions", body, headers=AUTH)
    assert status == 200
    return body, answer["choices"]


def _greedy(client, prompt: str = PROMPT, **kwargs):
    return client.completions.create(model="smollm2", prompt=prompt, temperature=0, **kwargs).choices[0]


def _continuation_ids(tokenizer, prompt: str, text: str) -> list[int]:
    """The ids the model generated for ``text`` after ``prompt`` (re-tokenized in context)."""
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.encode(prompt + text)
    assert ids[:len(prompt_ids)] == prompt_ids
    return ids[len(prompt_ids):]


def test_logit_bias_forces_and_bans_tokens(client, tokenizer):
    forced = tokenizer.encode(" banana", add_special_tokens=False)
    assert len(forced) == 1
    got = _greedy(client, max_tokens=3, logit_bias={str(forced[0]): 100})
    assert got.text == tokenizer.decode(forced * 3)

    plain = _greedy(client, max_tokens=1, logprobs=2)
    first = _continuation_ids(tokenizer, PROMPT, plain.text)
    assert len(first) == 1 and tokenizer.decode(first) == plain.text
    ranked = sorted(plain.logprobs.top_logprobs[0].items(), key=lambda kv: -kv[1])
    banned = _greedy(client, max_tokens=1, logprobs=2, logit_bias={str(first[0]): -100})
    assert banned.text == ranked[1][0]  # the runner-up
    # Logprobs are the model's own, bias or not.
    assert banned.logprobs.top_logprobs[0] == pytest.approx(plain.logprobs.top_logprobs[0], abs=1e-4)


def test_allowed_token_ids_and_bad_words(client, tokenizer):
    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    texts = {tokenizer.decode([t]) for t in allowed}
    got = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3, logprobs=0,
                                    extra_body={"allowed_token_ids": allowed, "ignore_eos": True}).choices[0]
    assert len(got.logprobs.tokens) == 6 and set(got.logprobs.tokens) <= texts

    plain = _greedy(client, max_tokens=4)
    word = plain.text.split()[0]
    assert len(word) > 2  # greedy writes the word that is banned next
    banned = _greedy(client, max_tokens=4, extra_body={"bad_words": [word]})
    assert word not in banned.text and banned.text != plain.text


def test_stop_reason_for_stop_strings_tokens_and_length(client, tokenizer):
    plain = _greedy(client, max_tokens=8)
    assert plain.finish_reason == "length" and plain.stop_reason is None
    stop = plain.text.split()[1]
    cut = _greedy(client, max_tokens=8, stop=[stop])
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    token = _continuation_ids(tokenizer, PROMPT, plain.text)[2]
    by_token = _greedy(client, max_tokens=8, extra_body={"stop_token_ids": [token]})
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", token)

    chunks = list(client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi!"}],
                                                 max_tokens=8, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    stop = text.split()[1]
    streamed = list(client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi!"}],
                                                   max_tokens=8, temperature=0, stream=True, stop=[stop]))
    ends = [(c.choices[0].finish_reason, c.choices[0].stop_reason) for c in streamed]
    assert ends[-1] == ("stop", stop) and set(ends[:-1]) == {(None, None)}


def test_continuous_usage_stats_add_up(client, tokenizer):
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}, stream_options={
                                                "include_usage": True, "continuous_usage_stats": True}))
    *content, final = chunks
    prompt_tokens = len(tokenizer.encode(PROMPT))
    assert final.choices == [] and (final.usage.prompt_tokens, final.usage.completion_tokens) == (prompt_tokens, 6)
    counts = [c.usage.completion_tokens for c in content]
    assert all(c.usage.prompt_tokens == prompt_tokens for c in content)
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in content)
    assert counts == sorted(counts) and counts[-1] == 6
    # Each chunk's count grows by the tokens of its text.
    ids = _continuation_ids(tokenizer, PROMPT, "".join(c.choices[0].text for c in content))
    assert len(ids) == 6
    plain = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=3, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_tokenize_and_detokenize_round_trip(server, tokenizer):
    text = "Hello, world! Tokenize me: naïve café."
    status, got = server.request("POST", "/tokenize", {"model": "smollm2", "prompt": text, "return_token_strs": True},
                                 headers=AUTH)
    ids = tokenizer.encode(text)
    assert status == 200
    assert got == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                   "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    status, bare = server.request("POST", "/tokenize", {"prompt": text, "add_special_tokens": False}, headers=AUTH)
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False) and bare["token_strs"] is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    status, chat = server.request("POST", "/tokenize", {"messages": messages}, headers=AUTH)
    assert status == 200
    assert chat["tokens"] == list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False))
    status, back = server.request("POST", "/detokenize", {"model": "smollm2", "tokens": ids}, headers=AUTH)
    assert status == 200 and back == {"prompt": tokenizer.decode(ids)}


@pytest.mark.parametrize("path, body, headers, status, needle", [
    ("/tokenize", {"prompt": "x"}, {}, 401, "API key"),
    ("/detokenize", {"tokens": [1]}, {}, 401, "API key"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, AUTH, 404, "does not exist"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, AUTH, 404, "does not exist"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, AUTH, 400, "exactly one"),
    ("/tokenize", {}, AUTH, 400, "exactly one"),
    ("/detokenize", {"tokens": [10**7]}, AUTH, 400, "10000000"),
    ("/detokenize", {"tokens": "abc"}, AUTH, 400, "tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 5}}, AUTH, 400, "[99999] in logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-3": 5}}, AUTH, 400, "[-3] in logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 5}}, AUTH, 400, "logit_bias keys"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "up"}}, AUTH, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stream": True, "logit_bias": {"99999": 5}}, AUTH, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "allowed_token_ids": [1, 10**6]}, AUTH,
     400, "[1000000] in allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, AUTH, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "bad_words": [""]}, AUTH, 400, "bad_words"),
    ("/v1/completions", {"prompt": "x", "bad_words": "word"}, AUTH, 400, "bad_words"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}}, AUTH,
     400, "continuous_usage_stats"),
])
def test_bad_input_gets_errors(server, reference, path, body, headers, status, needle):
    got, payload = server.request("POST", path, body, headers=headers)
    assert got == status and needle in payload["error"]["message"], payload


def test_the_server_is_unchanged_after_bad_input(server, reference):
    body, choices = reference
    status, answer = server.request("POST", "/v1/completions", body, headers=AUTH)
    assert status == 200 and answer["choices"] == choices
    server.wait_idle()


def _raw(server, method: str, path: str, headers: dict, body: bytes = b"") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request(method, path, body=body or None, headers=headers)
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}


def test_cors_preflight_and_response_headers(server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers = _raw(server, "OPTIONS", "/v1/chat/completions", preflight)  # no API key: a browser sends none
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {h.strip() for h in headers["access-control-allow-headers"].split(",")}
    assert "access-control-allow-credentials" not in headers
    status, headers = _raw(server, "OPTIONS", "/v1/chat/completions", {**preflight, "Origin": "https://evil.example"})
    assert status == 400 and "access-control-allow-origin" not in headers
    body = json.dumps({"prompt": "x"}).encode()
    status, headers = _raw(server, "POST", "/tokenize", {"Origin": ORIGIN, **AUTH}, body)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers = _raw(server, "POST", "/tokenize", {"Origin": ORIGIN}, body)  # errors carry them too
    assert status == 401 and headers["access-control-allow-origin"] == ORIGIN
    status, headers = _raw(server, "POST", "/tokenize", {"Origin": "https://evil.example", **AUTH}, body)
    assert status == 200 and "access-control-allow-origin" not in headers


def test_anthropic_messages_take_the_x_api_key_header(server):
    anthropic = pytest.importorskip("anthropic")
    ok = anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key=KEY, max_retries=0, timeout=120)
    message = ok.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert message.content and message.usage.output_tokens > 0
    wrong = anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert info.value.body["error"]["type"] == "authentication_error"
