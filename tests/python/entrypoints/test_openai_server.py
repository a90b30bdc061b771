"""`vpage serve` on the default model, over real HTTP on 127.0.0.1: the official openai
client, greedy parity with LLM.generate, 30+ kinds of bad request, disconnects, stalled
connections, metrics and the serving benchmark."""

from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bounded_loops import bounded
from live_server import LiveServer, stream_events

MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("--dtype", "float32", "--kv-cache-memory", "0.25", "--max-model-len", "1024",
                     "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", "512",
                     "--max-body-bytes", "200000", "--timeout-header", "3", "--timeout-body", "3")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_models_health_and_model_card(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert client.models.retrieve("smollm2").id == "smollm2"
    assert server.request("GET", "/v1/models/other")[0] == 404
    status, health = server.request("GET", "/health")
    assert status == 200 and health["status"] == "ok"


def test_greedy_text_equals_llm_generate(client):
    from vpage import LLM, SamplingParams

    prompts = ["The three primary colours are", "def fibonacci(n):"]
    llm = LLM(dtype="float32", device="cpu", kv_cache_memory=0.05, max_model_len=256)
    expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10),
                                                        use_tqdm=False)]
    del llm
    got = client.completions.create(model="smollm2", prompt=prompts, max_tokens=10, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == expected
    assert got.usage.completion_tokens == 20


def test_openai_client_features(client):
    # n > 1 with a seed is reproducible; logprobs; echo; stop
    kwargs = dict(model="smollm2", prompt="Once upon a time", n=2, max_tokens=6, temperature=0.9, seed=7)
    a, b = client.completions.create(**kwargs, logprobs=2), client.completions.create(**kwargs, logprobs=2)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2
    assert all(len(c.logprobs.tokens) == 6 and all(len(t) <= 2 for t in c.logprobs.top_logprobs) for c in a.choices)
    echo = client.completions.create(model="smollm2", prompt="Hello there", max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Hello there")
    full = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    stop = full.choices[0].text.strip()[:2] or "5"
    cut = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert stop not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"
    # chat, with logprobs and streaming that adds up to the whole answer
    messages = [{"role": "user", "content": "Name a fruit."}]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    streamed = list(client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8,
                                              temperature=0, stream=True))
    assert [c.choices[0].finish_reason for c in streamed][-1] == "length"


def test_prefix_cache_reports_cached_tokens(server):
    body = {"prompt": "A long shared preamble about paged attention and KV blocks. " * 8, "max_tokens": 2}
    server.request("POST", "/v1/completions", body)
    status, second = server.request("POST", "/v1/completions", body)
    assert status == 200 and second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


_LONG = "word " * 1100
BAD_REQUESTS = [
    # (path, JSON body or raw bytes, status, the field or a word the message names)
    ("/v1/completions", b"{not json", 400, "JSON"),
    ("/v1/completions", b"", 400, "JSON"),
    ("/v1/completions", b"[1, 2]", 400, "object"),
    ("/v1/completions", b"\xff\xfe{}", 400, "JSON"),
    ("/v1/completions", b'{"prompt": "\\ud800 lone surrogate"}', 400, "JSON"),
    ("/v1/completions", b"[" * 5000 + b"]" * 5000, 400, "JSON"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "JSON"),
    ("/v1/completions", b'{"prompt": "x", "temperature": Infinity}', 400, "JSON"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}', 400, "JSON"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": "high"}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 1, "top_p": 0.9,
                         "top_k": 9223372036854775808}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": "false"}, 400, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": "false"}, 400, "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3, "use_beam_search": True, "temperature": 0,
                         "length_penalty": "x"}, 400, "length_penalty"),
    ("/v1/completions", {"prompt": "x", "n": 2**31}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "n": MAX_NUM_SEQS + 1, "temperature": 1}, 400, "max-num-seqs"),
    ("/v1/completions", {"prompt": "x", "n": 1, "best_of": 65, "temperature": 1}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [2**70]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": 5}, 400, "stream_options"),
    ("/v1/completions", {"prompt": [-5, 3], "echo": True}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "out of range"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2000}, 400, "maximum context length is 1024"),
    ("/v1/completions", {"prompt": _LONG, "max_tokens": 1}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logprobs": 1000}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 50, "max_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "n": 1, "best_of": 3, "stream": True, "temperature": 1}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "cache_salt": 5}, 400, "cache_salt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "skip_special_tokens": "no"}, 400,
     "skip_special_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 50}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": _LONG}]}, 400, "maximum context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x" * 300000}, 413, "exceeds"),
    ("/v1/moderations", {"input": "x"}, 404, "no route"),
]


@pytest.fixture(scope="module")
def reference(server):
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    status, answer = server.request("POST", "/v1/completions", body)
    assert status == 200
    return body, answer["choices"]


@pytest.mark.parametrize("path, body, status, needle", BAD_REQUESTS,
                         ids=[f"{i}-{r[3]}" for i, r in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, reference, path, body, status,
                                                                     needle):
    raw = body if isinstance(body, bytes) else None
    got, payload = server.request("POST", path, None if raw is not None else body, raw=raw)
    assert got == status, payload
    error = payload["error"]
    assert error["code"] == status and error["type"] and needle in (error["message"] + str(error["param"])), payload
    assert "Traceback" not in error["message"] and "/" not in error["message"].replace("/v1/", "")
    ok, answer = server.request("POST", "/v1/completions", reference[0])
    assert ok == 200 and answer["choices"] == reference[1]


def _raw_exchange(port: int, data: bytes, timeout: float = 30.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _recv_response(sock: socket.socket) -> bytes:
    """One whole HTTP response with a Content-Length body (it may arrive in several segments)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _content_length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _content_length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _status_and_json(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("request_bytes, status", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}", 400),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431),
    (b"GET /v1/models?" + b"q" * 10000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"DELETE /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    (b"NOT-HTTP\r\n\r\n", 400),
], ids=["content-length-abc", "header-431", "url-414", "method-405", "not-http"])
def test_malformed_http_gets_json_errors(server, request_bytes, status):
    got, body = _status_and_json(_raw_exchange(server.port, request_bytes))
    assert got == status and body["error"]["code"] == status


def test_keep_alive_and_pipelining(server):
    one = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    response = _raw_exchange(server.port, one + one + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert response.count(b"HTTP/1.1 200") == 3


def test_stalled_connections_do_not_stop_a_normal_client(server, reference):
    stalled = []
    try:
        for i in range(200):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            # half a request: headers never finished, or a body shorter than its Content-Length
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else
                         b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
            stalled.append(sock)
        status, answer = server.request("POST", "/v1/completions", reference[0], timeout=60)
        assert status == 200 and answer["choices"] == reference[1]
    finally:
        for sock in stalled:
            sock.close()


def test_stalled_heads_and_bodies_time_out(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        assert sock.recv(100) == b""  # closed by the server (--timeout-header), before the socket's timeout
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        status, body = _status_and_json(_recv_response(sock))
        assert status == 408 and body["error"]["code"] == 408


def test_disconnected_non_streaming_request_is_aborted(server):
    generated = server.metric("generation_tokens_total")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Tell me a long story", "max_tokens": 800,
                                                             "ignore_eos": True}).encode())
    for _ in bounded(lambda: server.metric("num_requests_running") == 0, 1200, "the request did not start"):
        time.sleep(0.05)
    conn.sock.close()
    server.wait_idle()
    assert server.metric("generation_tokens_total") - generated < 800
    assert server.metric("request_success_total") >= 1


def test_64_streams_with_30_percent_disconnecting(server):
    def client(i: int):
        leaves = i % 10 < 3
        body = {"prompt": f"Story number {i}:", "max_tokens": 400 if leaves else 6, "temperature": 0,
                "ignore_eos": True, "stream": True}
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode())
        resp = conn.getresponse()
        if leaves:
            resp.readline()  # the first event arrived: generation started
            conn.sock.close()
            return None
        events = [b for b in resp.read().decode().split("\n\n") if b]
        conn.close()
        return events

    with ThreadPoolExecutor(64) as pool:
        futures = [pool.submit(client, i) for i in range(64)]
        for _ in bounded(lambda: server.metric("num_requests_running") == 0, 2400, "no request started"):
            time.sleep(0.05)
        assert server.request("GET", "/health")[0] == 200  # while requests are running
        results = [f.result() for f in futures]
    finished = [r for r in results if r is not None]
    assert len(finished) == 64 - sum(i % 10 < 3 for i in range(64))
    for events in finished:
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    server.wait_idle()


def test_serving_benchmark_against_the_server(server):
    from vpage.benchmarks.serve import run_benchmark

    trace = [("Once upon a time", 5), ("The weather today is", 5), ("In a galaxy far away", 5)]
    report = run_benchmark(server.base_url, trace, max_concurrency=3, slo_ttft_ms=600000, slo_tpot_ms=600000,
                           progress=False)
    assert report["completed"] == 3 and report["failed"] == 0 and report["total_output_tokens"] == 15
    assert report["goodput"] > 0 and report["ttft_ms"]["p99"] >= report["ttft_ms"]["median"] > 0


def test_metrics_have_vllm_names_and_the_model_label(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    names = ["num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
             "cpu_cache_usage_perc", "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
             "prefix_cache_queries_total", "prefix_cache_hits_total", "time_to_first_token_seconds_bucket",
             "inter_token_latency_seconds_bucket", "time_per_output_token_seconds_bucket",
             "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
             "iteration_tokens_total_bucket", "request_prompt_tokens_bucket", "request_generation_tokens_bucket"]
    for name in names:
        assert f'vpage:{name}{{' in text and 'model_name="smollm2"' in text, name
    assert 'vpage:request_success_total{finished_reason="length",model_name="smollm2"}' in text


def test_latency_metrics_keep_streamed_and_whole_responses_apart(server):
    def count(stream: str) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", "/metrics")
        lines = conn.getresponse().read().decode().splitlines()
        conn.close()
        key = f'vpage:e2e_request_latency_seconds_count{{model_name="smollm2",stream="{stream}"}}'
        return float(next(line for line in lines if line.startswith(key)).rsplit(" ", 1)[1])

    before = count("true"), count("false")
    body = {"prompt": "Hello", "max_tokens": 2}
    assert server.request("POST", "/v1/completions", body)[0] == 200
    assert server.request("POST", "/v1/completions", body)[0] == 200
    stream_events(server, "/v1/completions", body)
    deadline = time.monotonic() + 10
    while (count("true"), count("false")) != (before[0] + 1, before[1] + 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (count("true"), count("false")) == (before[0] + 1, before[1] + 2)
