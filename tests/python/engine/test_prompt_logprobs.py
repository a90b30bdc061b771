"""SamplingParams.prompt_logprobs and /v1/completions echo + logprobs.

In process, on a tiny random Llama saved to disk: every prompt token's logprob equals
transformers' float32 log-softmax of the same weights (within 1e-4), with its rank and the
top-k ids, for prompts split across prefill chunks, sharing a prefix that the prefix cache
holds, preempted by recompute in the middle of their prefill, and under tensor parallelism;
DELTA outputs carry them once; an abort mid-prefill leaves nothing behind; LLM.generate takes
vLLM's prompt dicts. Over HTTP against ``vpage serve`` on the default model: the exact request
lm-evaluation-harness's ``local-completions`` model sends, parsed as it parses it, equals the
in-process prompt logprobs of the same tokens; ``max_tokens: 0`` with echo scores a prompt;
streamed echo carries the prompt logprobs in its first chunk; the ``prompt_logprobs`` field in
completions and chat; bad values are 400s and the server keeps serving.
"""

from __future__ import annotations

import threading

import pytest
import torch

from bounded_loops import bounded
from live_server import LiveServer, stream_events
from model_fixtures import save_tiny_model
from vpage import LLM, EngineArgs, LLMEngine, SamplingParams
from vpage.sampling_params import RequestOutputKind

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 8
_BLOCK_BYTES = 4096  # one KV block of the tiny Llama: K and V, 2 layers x 2 KV heads x 16 dims x 8 tokens, float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, save_tiny_model("llama", folder, seed=3)


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax: row p scores token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check(hf, prompt: list[int], entries, k: int) -> None:
    """``entries`` are the prompt logprobs of ``prompt`` (top ``k``), as transformers has them."""
    ref = _reference(hf, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        row, token, entry = ref[p - 1], prompt[p], entries[p]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4, p
        assert entry[token].rank == 1 + int((row > row[token]).sum()), p
        top = row.topk(k).indices.tolist()
        # The prompt token first, then the top k best first (the token once, where it is among them).
        assert list(entry) == [token] + [t for t in top if t != token], p
        assert all(entry[t].rank == i + 1 for i, t in enumerate(top)), p
        for t in entry:
            assert abs(entry[t].logprob - row[t].item()) < 1e-4, p


def _engine(folder, **kwargs) -> LLMEngine:
    args = dict(model=str(folder), dtype="float32", block_size=BS, kv_cache_memory=0.01)
    args.update(kwargs)
    return LLMEngine(EngineArgs(**args))


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Every output of every request, by id."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list] = {rid: [] for rid in requests}
    for _ in bounded(engine.has_unfinished_requests, 10_000, "requests still unfinished"):
        for out in engine.step():
            outputs[out.request_id].append(out)
        engine.scheduler.check_invariants()
    return outputs


def test_chunked_and_prefix_cached_prompts_match_transformers(tiny):
    folder, hf = tiny
    engine = _engine(folder, max_num_batched_tokens=16)  # 16-token prefill chunks
    long, short = _prompt(0, 70), _prompt(1, 23)
    shared = long[:40] + _prompt(2, 9)
    plain = SamplingParams(temperature=0, max_tokens=2)
    # Blocks of `long`'s first 40 tokens are cached before the prompt_logprobs requests come.
    first = _run(engine, {"prefix": (long[:40], plain)})
    assert first["prefix"][-1].num_cached_tokens == 0
    out = _run(engine, {"long": (long, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)),
                        "short": (short, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)),
                        "cached": (shared, plain)})
    assert out["cached"][-1].num_cached_tokens == 40  # the prefix was there to hit
    assert out["long"][-1].num_cached_tokens == 0  # a prompt_logprobs request computes every row
    _check(hf, long, out["long"][-1].prompt_logprobs, 3)
    _check(hf, short, out["short"][-1].prompt_logprobs, 0)
    assert out["cached"][-1].prompt_logprobs is None
    # A one-token prompt has only the None entry.
    one = _run(engine, {"one": ([17], SamplingParams(max_tokens=1, prompt_logprobs=2))})
    assert one["one"][-1].prompt_logprobs == [None]


def test_delta_outputs_carry_them_once_through_a_preemption_mid_prefill(tiny):
    folder, hf = tiny
    # 17 blocks: "a" decoding needs a block while "b" is half way through its 13 prefill chunks,
    # and "b" (the latest) is preempted by recompute.
    engine = _engine(folder, kv_cache_memory=17 * _BLOCK_BYTES / 2**30, preemption_mode="recompute",
                     max_num_batched_tokens=8, max_model_len=128)
    a, b = _prompt(3, 20), _prompt(4, 100)
    delta = dict(temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("a", a, SamplingParams(max_tokens=60, **delta))
    engine.add_request("b", b, SamplingParams(max_tokens=4, prompt_logprobs=2, **delta))
    preempted_mid_prefill = False
    carried = []
    for _ in bounded(engine.has_unfinished_requests, 10_000, "requests still unfinished"):
        state, group = engine.core.requests.get("b"), engine.scheduler.find_group("b")
        before = None if group is None else (group.num_preemptions, state.num_prompt_scored)
        for out in engine.step():
            if out.prompt_logprobs is not None:
                carried.append((out.request_id, out.prompt_logprobs))
        group = engine.scheduler.find_group("b")
        if before and group is not None and group.num_preemptions > before[0] and before[1] < len(b):
            preempted_mid_prefill = True
        engine.scheduler.check_invariants()
    assert preempted_mid_prefill
    assert [rid for rid, _ in carried] == ["b"]
    _check(hf, b, carried[0][1], 2)


def test_abort_mid_prefill_leaves_nothing(tiny):
    folder, _ = tiny
    engine = _engine(folder, max_num_batched_tokens=8)
    engine.add_request("x", _prompt(5, 60), SamplingParams(max_tokens=2, prompt_logprobs=1))
    engine.step()
    engine.step()
    assert engine.core.requests["x"].num_prompt_scored == 1 + 16  # the first prompt token has no score
    engine.abort_request("x")
    assert not engine.core.prompt_logprobs.pending and not engine.has_unfinished_requests()
    usage = engine.scheduler.usage()
    assert usage.free_gpu_blocks == usage.num_gpu_blocks
    engine.scheduler.check_invariants()


def test_tensor_parallel_matches_transformers(tiny):
    folder, hf = tiny
    engine = _engine(folder, tensor_parallel_size=2, num_threads=2, max_num_batched_tokens=16)
    try:
        prompts = {"p": _prompt(6, 45), "q": _prompt(7, 30)}
        out = _run(engine, {rid: (p, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=4))
                            for rid, p in prompts.items()})
    finally:
        engine.shutdown()
    for rid, prompt in prompts.items():
        _check(hf, prompt, out[rid][-1].prompt_logprobs, 4)


def test_llm_generate_takes_prompt_dicts(tiny):
    folder, _ = tiny
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=0.01, block_size=BS)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    ids = _prompt(8, 12)
    text = "the quick brown fox"
    plain = llm.generate([ids, text], params, use_tqdm=False)
    dicts = llm.generate([{"prompt_token_ids": ids}, {"prompt": text, "cache_salt": "s"}], params, use_tqdm=False)
    single = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    for a, b in zip(plain + plain[:1], dicts + single):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt_token_ids == b.prompt_token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert list(x) == list(y) and all(abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)
    assert dicts[1].prompt == text
    with pytest.raises(ValueError, match="unsupported prompt keys"):
        llm.generate({"prompt": text, "multi_modal_data": {}}, params, use_tqdm=False)


# ------------------------------------------------------------------ over HTTP


@pytest.fixture(scope="module")
def served():
    """``vpage serve`` on the default model (small prefill chunks, so the prompts below are scored
    across several steps) and the same model in process (the reference), loaded side by side."""
    local: dict = {}
    loader = threading.Thread(target=lambda: local.setdefault("llm", LLM(
        dtype="float32", device="cpu", kv_cache_memory=0.05, max_model_len=512)))
    loader.start()
    try:
        srv = LiveServer("--dtype", "float32", "--kv-cache-memory", "0.1", "--max-model-len", "512",
                         "--max-num-seqs", "8", "--max-num-batched-tokens", "16")
    finally:
        loader.join()
    assert "llm" in local, "the in-process model did not load"
    yield srv, local["llm"]
    srv.stop()


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def smollm2(served):
    return served[1]


_CONTEXTS = [("Question: What is the capital of France?\nAnswer:", [" Paris", " Berlin"]),
             ("The sun rises in the", [" east", " west"])]


def _lm_eval_requests(tokenizer) -> tuple[list[list[int]], list[int]]:
    """What lm-eval's loglikelihood sends: context + continuation token ids, and the contexts' lengths."""
    tokens, ctxlens = [], []
    for context, continuations in _CONTEXTS:
        ctx = tokenizer.encode(context)
        for cont in continuations:
            tokens.append(ctx + tokenizer.encode(cont))
            ctxlens.append(len(ctx))
    return tokens, ctxlens


def _parse_like_lm_eval(body: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """LocalCompletionsAPI.parse_logprobs: the continuation's summed logprobs and is_greedy
    (the last entry is the generated token)."""
    res = []
    for choice, ctxlen in zip(sorted(body["choices"], key=lambda c: c["index"]), ctxlens):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(token_logprobs), all(tok == max(top.values()) for tok, top in zip(token_logprobs, tops))))
    return res


def test_lm_eval_loglikelihood_request(server, smollm2):
    tokens, ctxlens = _lm_eval_requests(smollm2.get_tokenizer())
    body = {"model": "smollm2", "prompt": tokens, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    status, got = server.request("POST", "/v1/completions", body)
    assert status == 200, got
    reference = smollm2.generate([{"prompt_token_ids": t} for t in tokens],
                                 SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    expected = []
    for out, ctxlen in zip(reference, ctxlens):
        entries = out.prompt_logprobs[ctxlen:]
        tokens_ = out.prompt_token_ids[ctxlen:]
        expected.append((sum(e[t].logprob for e, t in zip(entries, tokens_)),
                         all(e[t].rank == 1 for e, t in zip(entries, tokens_))))
    parsed = _parse_like_lm_eval(got, ctxlens)
    for (lp, greedy), (want_lp, want_greedy) in zip(parsed, expected):
        assert abs(lp - want_lp) < 1e-3 and greedy == want_greedy
    assert parsed[0][0] > parsed[1][0]  # " Paris" is likelier than " Berlin"
    for choice, ids, out in zip(sorted(got["choices"], key=lambda c: c["index"]), tokens, reference):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the generated token
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for j in range(1, len(ids)):
            entry = out.prompt_logprobs[j]
            assert abs(lp["token_logprobs"][j] - entry[ids[j]].logprob) < 1e-3
            assert lp["tokens"][j] == entry[ids[j]].decoded_token
            assert len(lp["top_logprobs"][j]) <= 2
        # text_offset indexes the echoed text, the generated token's after the prompt's.
        text, offsets = choice["text"], lp["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets)
        assert text.startswith(smollm2.get_tokenizer().decode(ids))
        assert offsets[-1] == len(smollm2.get_tokenizer().decode(ids))
        for j, token in enumerate(lp["tokens"][:-1]):
            if token.isascii():
                assert text[offsets[j]:offsets[j] + len(token)] == token
        assert got["usage"]["completion_tokens"] == len(tokens)


def test_max_tokens_zero_with_echo_scores_the_prompt(server):
    ids = [504, 3458, 314, 253, 1789, 30]
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0}
    status, got = server.request("POST", "/v1/completions", body)
    assert status == 200, got
    choice = got["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["logprobs"]["token_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in choice["logprobs"]["token_logprobs"][1:])
    assert all(len(top) <= 3 for top in choice["logprobs"]["top_logprobs"][1:])
    assert got["usage"]["completion_tokens"] == 0 and got["usage"]["prompt_tokens"] == len(ids)
    # The same prompt streamed: one chunk carries the prompt and its logprobs, nothing is generated.
    events = stream_events(server, "/v1/completions", body)
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in chunks) == choice["text"]
    assert chunks[0]["logprobs"] == choice["logprobs"]
    assert chunks[-1]["finish_reason"] == choice["finish_reason"]


def test_streamed_echo_carries_the_prompt_logprobs_first(server):
    body = {"prompt": "Once upon a time", "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0}
    status, whole = server.request("POST", "/v1/completions", body)
    assert status == 200, whole
    events = stream_events(server, "/v1/completions", body)
    chunks = [e["choices"][0] for e in events if e["choices"]]
    whole_lp = whole["choices"][0]["logprobs"]
    prompt_len = whole["usage"]["prompt_tokens"]
    first = chunks[0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["tokens"]) >= prompt_len
    streamed = {k: sum((c["logprobs"][k] for c in chunks), []) for k in whole_lp}
    assert streamed["tokens"] == whole_lp["tokens"] and streamed["text_offset"] == whole_lp["text_offset"]
    assert [None if v is None else round(v, 3) for v in streamed["token_logprobs"]] == [
        None if v is None else round(v, 3) for v in whole_lp["token_logprobs"]]
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]


def test_prompt_logprobs_field_in_completions_and_chat(server):
    status, got = server.request("POST", "/v1/completions", {"prompt": [504, 3458, 314, 253], "max_tokens": 1,
                                                             "prompt_logprobs": 3})
    assert status == 200, got
    entries = got["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 4
    for entry, token in zip(entries[1:], [3458, 314, 253]):
        assert str(token) in entry and 3 <= len(entry) <= 4
        own = entry[str(token)]["rank"]
        assert sorted(v["rank"] for k, v in entry.items() if k != str(token)) == [r for r in (1, 2, 3) if r != own]
        assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in entry.values())
    status, chat = server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 1})
    assert status == 200, chat
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert "prompt_logprobs" not in chat["choices"][0]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 50},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0, "echo": True},
     "max_tokens"),
])
def test_bad_values_are_400_and_the_server_keeps_serving(server, path, body, param):
    status, got = server.request("POST", path, body)
    assert status == 400 and got["error"]["param"] == param, got
    status, ok = server.request("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "echo": True,
                                                            "logprobs": 0})
    assert status == 200 and ok["choices"][0]["text"].startswith("Hello")
    assert len(ok["choices"][0]["logprobs"]["tokens"]) == ok["usage"]["total_tokens"]
