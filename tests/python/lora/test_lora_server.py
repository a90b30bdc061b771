"""LoRA over HTTP with the official ``openai`` client: adapters from --lora-modules and loaded at
run time are listed in /v1/models (the base model as parent) and chosen by the request's model
field; they give PEFT's greedy tokens while requests under other adapters run; bad loads and
unknown names are 400/404 and leave the server serving."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from live_server import LiveServer
from lora_fixtures import MAX_TOKENS, PROMPTS, make_lora_setup

openai = pytest.importorskip("openai")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base, folders, expected = make_lora_setup(root)
    server = LiveServer("--model", base, "--dtype", "float32", "--kv-cache-memory", "0.01", "--enable-lora",
                        "--max-loras", "2", "--max-cpu-loras", "2", "--lora-modules", f"qv8={folders['qv8']}",
                        '{"name": "mlp16", "path": "%s"}' % folders["mlp16"],
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    yield server, base, folders, _expected_texts(base, folders, expected), root
    server.stop()


def _text(client, model: str, prompt: list[int]) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def _expected_texts(base: str, folders: dict[str, str], expected: dict) -> dict:
    """The greedy answers as text, from ``LLM`` with the same adapters (its tokens checked against
    PEFT's here: test_lora_peft.py holds them to PEFT in every batch shape)."""
    from vpage import LLM, LoRARequest, SamplingParams

    llm = LLM(base, dtype="float32", kv_cache_memory=0.01, enable_lora=True, max_loras=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    texts = {}
    for i, name in enumerate(expected):
        lora = LoRARequest(name, i + 1, folders[name]) if name else None
        outs = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected[name]
        texts[name] = [o.outputs[0].text for o in outs]
    return texts


def test_adapters_by_model_name(served):
    server, base, folders, expected, _ = served
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {base, "qv8", "mlp16"}
    assert models["qv8"].parent == base and models["qv8"].root == folders["qv8"]
    assert client.models.retrieve("mlp16").parent == base
    for name in (None, "qv8", "mlp16"):
        for p, prompt in enumerate(PROMPTS):
            assert _text(client, name or base, prompt) == expected[name][p], (name, p)
    _, metrics = server.request("GET", "/metrics")
    assert 'vpage:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics["raw"]


def test_load_and_unload_while_requests_run(served):
    server, base, folders, expected, _ = served

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none")

        async def completion(model: str, prompt: list[int]) -> str:
            out = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                                  extra_body={"ignore_eos": True})
            return out.choices[0].text

        running = [asyncio.create_task(completion(m, PROMPTS[p])) for m in ("qv8", base) for p in range(3)]
        status, body = await asyncio.to_thread(server.request, "POST", "/v1/load_lora_adapter",
                                               {"lora_name": "all4rs", "lora_path": folders["all4rs"]})
        assert status == 200, body
        loaded = [asyncio.create_task(completion("all4rs", PROMPTS[p])) for p in range(3)]
        results = await asyncio.gather(*running, *loaded)
        assert results[:3] == expected["qv8"] and results[3:6] == expected[None] and results[6:] == expected["all4rs"]
        status, body = await asyncio.to_thread(server.request, "POST", "/v1/unload_lora_adapter",
                                               {"lora_name": "all4rs"})
        assert status == 200, body

    asyncio.run(run())
    status, body = server.request("POST", "/v1/completions", {"model": "all4rs", "prompt": PROMPTS[0], "max_tokens": 2})
    assert status == 404 and "all4rs" in body["error"]["message"]


def test_bad_adapters_are_clear_errors(served):
    server, base, folders, expected, root = served
    status, body = server.request("POST", "/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": str(root / "x")})
    assert status == 404, body
    status, body = server.request("POST", "/v1/load_lora_adapter", {"lora_name": "qv8", "lora_path": folders["qv8"]})
    assert status == 400 and "already loaded" in body["error"]["message"]
    wrong = root / "wrong"  # an adapter of another base: lora_A with 32 columns where this model has 64
    shutil.copytree(folders["qv8"], wrong, dirs_exist_ok=True)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(wrong / "adapter_model.safetensors"))
    save_file({k: (v[:, :32] if "lora_A" in k else v).contiguous() for k, v in tensors.items()},
              str(wrong / "adapter_model.safetensors"))
    status, body = server.request("POST", "/v1/load_lora_adapter", {"lora_name": "wrong", "lora_path": str(wrong)})
    assert status == 400 and "does not fit the base model" in body["error"]["message"]
    status, body = server.request("POST", "/v1/unload_lora_adapter", {"lora_name": "never"})
    assert status == 404, body
    status, body = server.request("POST", "/v1/chat/completions",
                                  {"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 404 and "`nope`" in body["error"]["message"]
    client = openai.OpenAI(base_url=server.base_url, api_key="none")  # still serving, adapters intact
    assert {m.id for m in client.models.list().data} == {base, "qv8", "mlp16"}
    assert _text(client, "qv8", PROMPTS[0]) == expected["qv8"][0]
