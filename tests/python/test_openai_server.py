"""The OpenAI-compatible server on the default model, over real HTTP on a local port."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from vpage.cli import main as cli_main
from vpage.engine import EngineArgs, LLMEngine
from vpage.engine.engine_loop import EngineLoop
from vpage.entrypoints.openai.api_server import OpenAIServer


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineArgs(dtype="float32", device="cpu", kv_cache_memory=0.25,
                                  max_num_batched_tokens=512, max_model_len=1024))
    loop = EngineLoop(engine)
    srv = OpenAIServer(loop, "smollm2", "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    loop.shutdown()


def request(srv, method, path, body=None, raw=None):
    """(status, parsed JSON body) of one request."""
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=120)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    status, payload = resp.status, json.loads(resp.read())
    conn.close()
    return status, payload


def stream_events(srv, path, body):
    """The parsed `data:` events of a streamed request, up to (not including) [DONE]."""
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=120)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode())
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    events = []
    for line in resp.read().decode().split("\n\n"):
        if not line:
            continue
        assert line.startswith("data: ")
        if line == "data: [DONE]":
            break
        events.append(json.loads(line[len("data: "):]))
    else:
        raise AssertionError("the stream did not end with [DONE]")
    conn.close()
    return events


def assert_idle(srv):
    """Every request finished or aborted, every KV block free again."""
    deadline = time.monotonic() + 30
    while srv.loop.num_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    status, health = request(srv, "GET", "/health")
    assert status == 200 and health["unfinished_requests"] == 0
    usage = srv.loop.engine.scheduler.usage()
    assert usage.free_gpu_blocks == usage.num_gpu_blocks


def test_models_and_health(server):
    status, models = request(server, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["smollm2"]
    assert models["data"][0]["max_model_len"] == 1024
    assert request(server, "GET", "/health")[0] == 200


def test_greedy_completion_matches_transformers(server, hf_model):
    tokenizer = server.loop.engine.tokenizer
    prompt = "The three primary colours are"
    status, body = request(server, "POST", "/v1/completions",
                           {"model": "smollm2", "prompt": prompt, "max_tokens": 20, "temperature": 0})
    assert status == 200, body
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        ref = hf_model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    choice = body["choices"][0]
    assert choice["text"] == tokenizer.decode(ref[0, ids.shape[1]:], skip_special_tokens=True)
    assert choice["finish_reason"] == "length" and body["object"] == "text_completion"
    assert body["usage"] == {"prompt_tokens": ids.shape[1], "completion_tokens": 20, "total_tokens": ids.shape[1] + 20}


def test_chat_stream_equals_chat_response(server):
    body = {"messages": [{"role": "system", "content": "You are brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]}],
            "max_tokens": 24, "temperature": 0}
    status, whole = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200, whole
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    events = stream_events(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == message["content"]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == whole["choices"][0]["finish_reason"]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]


def test_several_prompts_n_echo_and_logprobs(server):
    status, body = request(server, "POST", "/v1/completions",
                           {"prompt": ["Once upon a time", [504, 3458, 314]], "n": 2, "max_tokens": 5,
                            "temperature": 0.8, "seed": 3, "logprobs": 2, "echo": True})
    assert status == 200, body
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]
    first = [c for c in body["choices"] if c["index"] < 2]
    assert all(c["text"].startswith("Once upon a time") for c in first)
    for c in body["choices"]:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
        assert all(len(top) <= 2 and all(v <= 0 for v in top.values()) for top in lp["top_logprobs"])
    assert body["usage"]["completion_tokens"] == 20

    status, chat = request(server, "POST", "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
                            "logprobs": True, "top_logprobs": 3})
    assert status == 200, chat
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"]
    assert all(len(t["top_logprobs"]) == 3 and t["logprob"] <= 0 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(t["token"] == t["top_logprobs"][0]["token"] for t in content)


def test_beam_search_through_the_api(server):
    status, body = request(server, "POST", "/v1/completions",
                           {"prompt": "The best way to learn is", "n": 2, "best_of": 3, "use_beam_search": True,
                            "temperature": 0, "max_tokens": 6})
    assert status == 200, body
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert len(texts) == 2 and texts[0] != texts[1]
    assert_idle(server)


def test_concurrent_requests_give_their_sequential_results(server):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(6)]
    body = {"max_tokens": 12, "temperature": 0}
    sequential = [request(server, "POST", "/v1/completions", {**body, "prompt": p})[1] for p in prompts]
    with ThreadPoolExecutor(6) as pool:
        concurrent = list(pool.map(lambda p: request(server, "POST", "/v1/completions", {**body, "prompt": p})[1],
                                   prompts))
    assert [r["choices"][0]["text"] for r in concurrent] == [r["choices"][0]["text"] for r in sequential]
    assert_idle(server)


@pytest.mark.parametrize("path, body, raw, status, needle", [
    ("/v1/completions", None, b"{not json", 400, "not valid JSON"),
    ("/v1/completions", {"max_tokens": 3}, None, 400, "prompt must be"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, None, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": "high"}, None, 400, "not supported between"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, None, 404, "does not exist"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2000}, None, 400, "maximum context length is 1024"),
    ("/v1/completions", {"prompt": "word " * 1100, "max_tokens": 1}, None, 400, "1101 prompt tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1100}]}, None, 400,
     "max_model_len is 1024"),
    ("/v1/completions", {"prompt": [10**9]}, None, 400, "out of range"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 5}}, None, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1000}, None, 400, "logprobs must be"),
    ("/v1/completions", {"prompt": "x", "n": 1, "best_of": 3, "stream": True}, None, 400, "best_of equal to n"),
    ("/v1/completions", {"prompt": "x", "n": 2, "use_beam_search": True, "temperature": 0, "stream": True}, None,
     400, "no beam search"),
    ("/v1/chat/completions", {"messages": []}, None, 400, "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, None, 400, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 50}, None, 400, "top_logprobs"),
    ("/v1/embeddings", {"input": "x"}, None, 404, "no route"),
])
def test_bad_requests_get_clear_errors_and_leave_the_server_serving(server, path, body, raw, status, needle):
    got, payload = request(server, "POST", path, body, raw)
    assert got == status and needle in payload["error"]["message"], payload
    assert payload["error"]["code"] == status
    assert_idle(server)
    assert request(server, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2})[0] == 200


def test_client_leaving_a_stream_aborts_its_request(server):
    generated_before = server.loop.engine.get_stats().generation_tokens
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    conn.request("POST", "/v1/completions",
                 body=json.dumps({"prompt": "Tell me a long story", "max_tokens": 1000, "stream": True,
                                  "ignore_eos": True}).encode())
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")  # generation has started
    resp.close()
    conn.close()
    assert_idle(server)
    assert server.loop.engine.get_stats().generation_tokens - generated_before < 1000  # stopped early


def test_cli_serve_reports_a_missing_model(capsys, tmp_path):
    assert cli_main(["serve", "--model", str(tmp_path / "absent"), "--port", "0"]) == 2
    assert "vpage: error:" in capsys.readouterr().err


def test_a_failing_engine_step_fails_requests_cleanly(monkeypatch):
    """A step that raises aborts every request (blocks freed), answers 503, and later requests
    get 503 at once instead of hanging."""
    engine = LLMEngine(EngineArgs(dtype="float32", device="cpu", kv_cache_memory=0.05, max_model_len=256))

    def broken_step():
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine, "step", broken_step)
    loop = EngineLoop(engine)
    srv = OpenAIServer(loop, "smollm2", "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        for _ in range(2):
            status, body = request(srv, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
            assert status == 503 and "injected failure" in body["error"]["message"], body
        assert not engine.has_unfinished_requests()
        usage = engine.scheduler.usage()
        assert usage.free_gpu_blocks == usage.num_gpu_blocks
    finally:
        srv.shutdown()
        srv.server_close()
        loop.shutdown()
