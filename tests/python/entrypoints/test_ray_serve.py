"""`vpage serve --ray-serve` on a tiny random model: two engine replicas placed by Ray Serve
behind vpage's OpenAI app, through the official `openai` client: the same greedy text as one
engine, a prompt's prefix sent back to the replica that computed it, errors in the API's
shape; SIGTERM removes the app and Ray with it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from model_fixtures import save_tiny_model

pytestmark = pytest.mark.timeout(600)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-serve")
    save_tiny_model("llama", folder, max_position_embeddings=4096)
    return str(folder)


def test_ray_serve_replicas_route_by_prefix(tiny_model):
    from vpage import LLM, SamplingParams

    prompts = [list(range(3 + 7 * i, 70 + 7 * i)) for i in range(4)]  # 67 tokens: 4 full blocks each
    llm = LLM(tiny_model, dtype="float32", kv_cache_memory=0.02)
    want = [out.outputs[0].text for out in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    del llm
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vpage.cli", "serve", "--ray-serve", "--model", tiny_model,
                             "--dtype", "float32", "--kv-cache-memory", "0.02", "--max-num-seqs", "4",
                             "--data-parallel-size", "2", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"})
    output: list[bytes] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            output.append(line)
            if re.search(rb"vpage: serving \S+ on http://", line):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not ready.wait(0.5):
            assert proc.poll() is None and time.monotonic() < deadline, b"".join(output).decode(errors="replace")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        extra = {"ignore_eos": True}
        for prompt, text in zip(prompts, want):
            answer = client.completions.create(model=tiny_model, prompt=prompt, max_tokens=12, temperature=0,
                                               extra_body=extra)
            assert answer.choices[0].text == text
        # Each prompt again with a new tail: routed to the replica that cached its prefix.
        for prompt in prompts:
            answer = client.completions.create(model=tiny_model, prompt=prompt + [1, 2, 3], max_tokens=4,
                                               temperature=0, extra_body=extra)
            assert answer.usage.prompt_tokens_details.cached_tokens == 64
        stream = client.completions.create(model=tiny_model, prompt=prompts[0], max_tokens=12, temperature=0,
                                           stream=True, extra_body=extra)
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == want[0]
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model=tiny_model, prompt=prompts[0], max_tokens=-1)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
