"""The agent round trip through each API of one `vpage serve`: chat completions, Responses and
Anthropic Messages, streamed, at N concurrent conversations, in the same run.

    python bench/bench_agent_apis.py [--conversations 64] [--concurrency 16] [--rounds 2]
        [--json OUT] [--markdown OUT]

A conversation is an agent's tool round trip: the user asks for the weather in a city, the
model calls `get_weather` (a named tool_choice, so every API gets a call), the tool's result
goes back (chat and Messages: the whole history; Responses: `previous_response_id` and the
`function_call_output` alone), and the model answers in text (tool_choice none). Greedy, every
turn streamed, the same token budgets; the server is the default model with the Hermes-style
tool template of the tests (`--enable-auto-tool-choice --tool-call-parser hermes`), prefix
caching on (as served). APIs alternate within a round (chat first in odd rounds, last in even
ones). Reported per API: conversations/s, output tok/s (summed usage), round-trip latency
p50/p99 (both turns, queueing included), and the ratio of its conversations/s to chat's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

_TEMPLATE = Path(__file__).resolve().parent.parent / "tests" / "python" / "hermes_tool_template.jinja"
CITIES = ["Paris", "Rome", "Berlin", "Madrid", "Vienna", "Lisbon", "Prague", "Oslo"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"], "additionalProperties": False}
CALL_TOKENS, ANSWER_TOKENS = 48, 32


def _events(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


async def _stream(http: httpx.AsyncClient, path: str, body: dict, headers: dict) -> list[dict]:
    async with http.stream("POST", path, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{path}: {resp.status_code} {(await resp.aread())[:300]!r}")
        return _events([line async for line in resp.aiter_lines()])


async def chat_round_trip(http: httpx.AsyncClient, city: str) -> int:
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                               "parameters": SCHEMA}}]
    messages = [{"role": "user", "content": f"What is the weather in {city}?"}]
    common = {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "tools": tools}
    first = await _stream(http, "/v1/chat/completions", {
        **common, "messages": messages, "max_tokens": CALL_TOKENS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, {})
    calls: dict[int, dict] = {}
    for chunk in first:
        for choice in chunk.get("choices") or ():
            for call in (choice.get("delta") or {}).get("tool_calls") or ():
                entry = calls.setdefault(call["index"], {"id": call.get("id"), "arguments": ""})
                entry["arguments"] += (call.get("function") or {}).get("arguments") or ""
    call = calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
                 {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature": 21})}]
    second = await _stream(http, "/v1/chat/completions", {**common, "messages": messages,
                                                          "max_tokens": ANSWER_TOKENS, "tool_choice": "none"}, {})
    return sum(chunk["usage"]["completion_tokens"] for chunk in first + second if chunk.get("usage"))


async def responses_round_trip(http: httpx.AsyncClient, city: str) -> int:
    tools = [{"type": "function", "name": "get_weather", "description": "Get the weather", "parameters": SCHEMA}]
    common = {"temperature": 0, "stream": True, "tools": tools}
    first = await _stream(http, "/v1/responses", {**common, "input": f"What is the weather in {city}?",
                                                  "max_output_tokens": CALL_TOKENS,
                                                  "tool_choice": {"type": "function", "name": "get_weather"}}, {})
    done = first[-1]["response"]
    call = next(item for item in done["output"] if item["type"] == "function_call")
    second = await _stream(http, "/v1/responses", {
        **common, "previous_response_id": done["id"], "max_output_tokens": ANSWER_TOKENS, "tool_choice": "none",
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": json.dumps({"temperature": 21})}]},
        {})
    return done["usage"]["output_tokens"] + second[-1]["response"]["usage"]["output_tokens"]


async def messages_round_trip(http: httpx.AsyncClient, city: str) -> int:
    tools = [{"name": "get_weather", "description": "Get the weather", "input_schema": SCHEMA}]
    messages = [{"role": "user", "content": f"What is the weather in {city}?"}]
    common = {"temperature": 0, "stream": True, "tools": tools}
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01"}
    first = await _stream(http, "/v1/messages", {**common, "messages": messages, "max_tokens": CALL_TOKENS,
                                                 "tool_choice": {"type": "tool", "name": "get_weather"}}, headers)
    block = next(e["content_block"] for e in first if e["type"] == "content_block_start"
                 and e["content_block"]["type"] == "tool_use")
    arguments = "".join(e["delta"]["partial_json"] for e in first if e["type"] == "content_block_delta"
                        and e["delta"]["type"] == "input_json_delta")
    messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": block["id"], "name": "get_weather",
                                                     "input": json.loads(arguments)}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"],
                                               "content": json.dumps({"temperature": 21})}]}]
    second = await _stream(http, "/v1/messages", {**common, "messages": messages, "max_tokens": ANSWER_TOKENS,
                                                  "tool_choice": {"type": "none"}}, headers)
    return sum(e["usage"]["output_tokens"] for e in first + second if e["type"] == "message_delta")


APIS = {"chat": chat_round_trip, "responses": responses_round_trip, "messages": messages_round_trip}


async def run_api(base_url: str, api: str, conversations: int, concurrency: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        async def one(i: int) -> None:
            nonlocal tokens
            async with limit:
                start = time.perf_counter()
                got = await APIS[api](http, CITIES[i % len(CITIES)])
                latencies.append(time.perf_counter() - start)
                tokens += got  # after the await: `tokens += await ...` would read tokens before it

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(conversations)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {"api": api, "conversations_per_s": conversations / elapsed, "output_tok_per_s": tokens / elapsed,
            "p50_s": statistics.median(latencies), "p99_s": latencies[min(len(latencies) - 1,
                                                                          int(0.99 * len(latencies)))]}


def start_server(args) -> tuple[subprocess.Popen, str]:
    """The server and its URL without ``/v1``."""
    from bench_serving import start_vpage_serve

    proc, url = start_vpage_serve(["--dtype", "float32", "--kv-cache-memory", "1", "--max-num-seqs",
                                   str(args.concurrency), "--max-model-len", "1024", "--chat-template", str(_TEMPLATE),
                                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    return proc, url.removesuffix("/v1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_structured_serving import cpu_description

    proc, base_url = start_server(args)
    rows = []
    try:
        for api in APIS:  # warm-up: one conversation each
            asyncio.run(run_api(base_url, api, 1, 1))
        for r in range(args.rounds):
            order = list(APIS) if r % 2 == 0 else list(reversed(APIS))
            for api in order:
                row = {"round": r + 1, **asyncio.run(run_api(base_url, api, args.conversations, args.concurrency))}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    lines = [f"CPU: {cpu_description()}; {args.conversations} conversations, {args.concurrency} at once", "",
             "| round | API | conversations/s | output tok/s | round trip p50 / p99 s | vs chat |",
             "|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        chat = next(x for x in rows if x["round"] == row["round"] and x["api"] == "chat")
        lines.append(f"| {row['round']} | {row['api']} | {row['conversations_per_s']:.2f} | "
                     f"{row['output_tok_per_s']:.1f} | {row['p50_s']:.2f} / {row['p99_s']:.2f} | "
                     f"{row['conversations_per_s'] / chat['conversations_per_s']:.2f}x |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
