"""Structured outputs through the engine: on the default model, JSON that jsonschema validates
and that ends the request by itself, json_object, regex, choice and EBNF grammars mixed with
free rows in one step (the free rows unchanged), parallel seeded samples, stop strings, bad
constraints refused with their reason; on tiny random models (fast), the llguidance backend,
preemption by recompute, chunked prefill, prefix-cache hits, requests waiting for their
grammar (aborted or failed), the reasoning gate and tensor parallelism."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from bounded_loops import bounded
from model_fixtures import save_tiny_model
from vpage import LLM, EngineArgs, LLMEngine, SamplingParams
from vpage.engine.core_io import EngineCoreRequest
from vpage.engine.core_process import EngineCoreProc
from vpage.reasoning import ReasoningParser, register
from vpage.sampling_params import RequestOutputKind
from vpage.sampling_params import StructuredOutputsParams as SO

TINY_VOCAB = 400  # wider than the tiny tokenizer's 320 tokens
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
SCHEMAS = [
    PERSON,
    {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}},
     "required": ["city", "population", "tags"], "additionalProperties": False},
]
# Finite languages: a random model must end them within a few dozen tokens.
FLAGS = {"type": "object", "properties": {"ok": {"type": "boolean"}, "mode": {"enum": ["fast", "slow"]}},
         "required": ["ok", "mode"], "additionalProperties": False}


# ------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smol():
    llm = LLM(max_model_len=1024, kv_cache_memory=0.25, max_num_seqs=16)
    yield llm
    llm.shutdown()


def chat(llm: LLM, text: str) -> list[int]:
    return list(llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}],
                                                        add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", folder, seed=5, vocab_size=TINY_VOCAB)
    return folder


def tiny_engine(folder, **kwargs) -> LLMEngine:
    args = dict(model=str(folder), dtype="float32", block_size=8, kv_cache_memory=0.01, num_threads=1,
                max_model_len=128)
    args.update(kwargs)
    return LLMEngine(EngineArgs(**args))


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    engine = tiny_engine(tiny_folder)
    yield engine
    engine.shutdown()


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], prefix: str = "r") -> list:
    """The final RequestOutput of every request, in order (all added at once)."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"{prefix}{i}", prompt, params)
    done = {}
    for _ in bounded(engine.has_unfinished_requests, 2000, "requests still unfinished"):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.take_request_errors()
    return [done[f"{prefix}{i}"] for i in range(len(requests))]


def greedy(so: SO | None = None, max_tokens: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, **kwargs)


def check(so: SO, text: str, tokenizer=None) -> None:
    """``text`` is in the language of ``so``."""
    if so.kind == "json":
        jsonschema.validate(json.loads(text), so.json)
    elif so.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif so.kind == "regex":
        assert re.fullmatch(so.regex, text), text
    elif so.kind == "choice":
        assert text in so.choice
    else:
        raise AssertionError(so.kind)


# ------------------------------------------------------------ default model


def _batch_requests(llm: LLM) -> dict[str, tuple[list[int], SamplingParams]]:
    person = chat(llm, "Give a person's name and age as JSON.")
    return {
        "person": (person, greedy(SO(json=PERSON), 48)),
        "colors": (chat(llm, "List two or three colors."), greedy(SO(json=json.dumps(SCHEMAS[1])), 48)),
        "city": (chat(llm, "Describe a city as JSON."), greedy(SO(json=SCHEMAS[2], disable_any_whitespace=True), 48)),
        "object": (chat(llm, 'Reply with the JSON object {"ok": true} and nothing else.'),
                   greedy(SO(json_object=True, disable_any_whitespace=True), 48)),
        "regex": (chat(llm, "Write a code."), greedy(SO(regex=r"[0-9]{3}-[a-z]{2,4}"), 48)),
        "choice": (chat(llm, "What is the weather like?"),
                   greedy(SO(choice=["sunny", "rainy", "cloudy"]), 48, logprobs=2)),
        "ebnf": (chat(llm, "Is water wet?"), greedy(SO(grammar='root ::= "Answer: " ("yes" | "no") "."'), 48)),
        # A stop string inside the constrained text still ends the sequence there.
        "stop": (chat(llm, "Name four fruits."), greedy(SO(regex=r"[a-z]+(, [a-z]+){3}"), 48, stop=[", "])),
        "seeded": (person, SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=48,
                                          structured_outputs=SO(json=PERSON))),
        "free0": ("The capital of France is", greedy(max_tokens=12)),
        "free1": ("def fibonacci(n):", greedy(max_tokens=12)),
    }


@pytest.fixture(scope="module")
def batch(smol):
    """Every kind of constraint and two free prompts in one generate call: their rows share
    each step (and its bitmask). name -> (prompt, params, RequestOutput)."""
    requests = _batch_requests(smol)
    outs = smol.generate([p for p, _ in requests.values()], [s for _, s in requests.values()], use_tqdm=False)
    return {name: (prompt, params, out) for (name, (prompt, params)), out in zip(requests.items(), outs)}


def test_json_schemas_validate_and_end_the_request(smol, batch):
    eos = smol.engine.model_config.eos_token_ids
    for name in ("person", "colors", "city", "object", "seeded"):
        _, params, out = batch[name]
        so = params.structured_outputs
        for o in out.outputs:
            check(SO(json=json.loads(so.json)) if isinstance(so.json, str) else so, o.text)
            # The finished JSON leaves only EOS: the request stops well before max_tokens.
            assert o.finish_reason == "stop" and o.token_ids[-1] in eos, (name, o.text)


def test_regex_choice_grammar_and_stop_string(batch):
    for name in ("regex", "choice"):
        _, params, out = batch[name]
        check(params.structured_outputs, out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"Answer: (yes|no)\.", batch["ebnf"][2].outputs[0].text)
    stopped = batch["stop"][2].outputs[0]
    assert re.fullmatch(r"[a-z]+", stopped.text) and stopped.finish_reason == "stop" and stopped.stop_reason == ", "


def test_free_rows_and_logprobs_are_the_models(smol, batch):
    names = ("free0", "free1")
    alone = smol.generate([batch[n][0] for n in names], greedy(max_tokens=12), use_tqdm=False)
    assert [batch[n][2].outputs[0].token_ids for n in names] == [o.outputs[0].token_ids for o in alone]
    # A constrained row reports the model's own logprobs: its first step's top tokens are the
    # free run's, whatever the grammar allowed.
    prompt, _, out = batch["choice"]
    free = smol.generate(prompt, greedy(max_tokens=1, logprobs=2), use_tqdm=False)[0].outputs[0]
    constrained_first = out.outputs[0].logprobs[0]
    for token, lp in free.logprobs[0].items():
        assert constrained_first[token].logprob == pytest.approx(lp.logprob, abs=1e-5)


def test_seeded_parallel_samples_do_not_depend_on_the_batch(smol, batch):
    prompt, params, out = batch["seeded"]
    assert len(out.outputs) == 2
    alone = smol.generate(prompt, params, use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in alone.outputs]


@pytest.mark.parametrize("so,reason", [
    (SO(json={"type": "object", "properties": {"a": {"type": "strng"}}}), "strng"),
    (SO(regex="[0-9"), "regex"),
    (SO(grammar='root ::= "a" missing'), "missing"),
    (SO(grammar='start: "a"'), "llguidance"),
])
def test_bad_constraints_are_refused_and_the_engine_serves(smol, so, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        smol.generate("Hi", greedy(so), use_tqdm=False)
    assert not smol.engine.has_unfinished_requests()
    # The engine core answers such a request with a 400 naming the reason.
    params = greedy(so)
    params.output_kind = RequestOutputKind.DELTA
    error = EngineCoreProc(smol.engine.core).add(EngineCoreRequest("bad", [1, 2, 3], params, 0.0))
    assert error.status == 400 and reason in error.message
    assert smol.generate("Hi", greedy(SO(choice=["a", "b"])), use_tqdm=False)[0].outputs[0].text in ("a", "b")


def test_beam_search_with_a_grammar_is_refused(smol):
    params = SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, structured_outputs=SO(regex="a+"))
    with pytest.raises(ValueError, match="beam search does not support structured outputs"):
        smol.generate("Hi", params, use_tqdm=False)


# ------------------------------------------------------------- tiny models


def test_llguidance_backend_lark_and_json(tiny_folder):
    engine = tiny_engine(tiny_folder, structured_outputs_backend="llguidance")
    try:
        lark = 'start: "id-" NUM ("," NUM)?\nNUM: /[0-9]{2}/'
        sos = [SO(grammar=lark), SO(json=FLAGS, disable_any_whitespace=True), SO(regex="[a-c]{3}"),
               SO(choice=["fox", "dog"])]
        outs = run(engine, [([5, 9, 17], SamplingParams(temperature=t, seed=3, max_tokens=60, structured_outputs=so))
                            for so in sos for t in (0.0, 1.0)])
        for i, out in enumerate(outs):
            o, so = out.outputs[0], sos[i // 2]
            if so.kind == "grammar":
                assert re.fullmatch(r"id-[0-9]{2}(,[0-9]{2})?", o.text), o.text
            else:
                check(so, o.text)
            assert o.finish_reason == "stop" and max(o.token_ids) < 320  # never a padding id
    finally:
        engine.shutdown()


def test_grammar_end_finishes_even_without_eos_stop(tiny):
    so = SO(regex="[0-9]{2}")
    out = run(tiny, [([5, 9, 17], greedy(so, 30, ignore_eos=True))])[0].outputs[0]
    assert re.fullmatch("[0-9]{2}", out.text) and out.finish_reason == "stop" and len(out.token_ids) < 30


def test_preemption_by_recompute_keeps_outputs_valid(tiny_folder, tiny):
    # 25 KV blocks of 8 tokens; six requests of ~70 tokens each need about 60: they preempt
    # each other and are recomputed, the matchers untouched (recompute keeps the tokens).
    engine = tiny_engine(tiny_folder, kv_cache_memory=25.5 * tiny.executor.block_bytes() / 2**30,
                         preemption_mode="recompute", enable_prefix_caching=False)
    try:
        assert engine.num_gpu_blocks == 25
        so = SO(regex="[a-z]{40}")
        requests = [(list(range(10 + i, 40 + i)), greedy(so, 60)) for i in range(6)]
        outs = run(engine, requests, "p")
        assert engine.get_stats().num_preempted_recompute > 0
        before = tiny.get_stats().num_preempted_recompute
        unpreempted = run(tiny, requests, "np")  # a KV cache that holds them all
        assert tiny.get_stats().num_preempted_recompute == before
        for out, ref in zip(outs, unpreempted):
            check(so, out.outputs[0].text)
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    finally:
        engine.shutdown()


def test_chunked_prefill_and_prefix_cache_hit(tiny_folder):
    engine = tiny_engine(tiny_folder, max_num_batched_tokens=16, enable_chunked_prefill=True,
                         enable_prefix_caching=True)
    try:
        prompt = list(range(20, 70))  # 50 tokens: four chunks
        so = SO(json=FLAGS, disable_any_whitespace=True)
        first = run(engine, [(prompt, greedy(so, 60))], "c")[0]
        second = run(engine, [(prompt, greedy(so, 60))], "d")[0]
        assert second.num_cached_tokens >= 40
        check(so, first.outputs[0].text)
        assert first.outputs[0].token_ids == second.outputs[0].token_ids
        plain = tiny_engine(tiny_folder, enable_prefix_caching=False)
        try:
            assert run(plain, [(prompt, greedy(so, 60))])[0].outputs[0].token_ids == first.outputs[0].token_ids
        finally:
            plain.shutdown()
    finally:
        engine.shutdown()


class _Gate:
    """Holds the tiny engine's compiles until released."""

    def __init__(self, engine: LLMEngine, fail: str | None = None):
        self.release = threading.Event()
        backend = engine.core.structured.compiler.backend
        self.original = backend.compile
        self.fail = fail

        def compile(params):
            assert self.release.wait(60)
            if fail is not None:
                raise ValueError(fail)
            return self.original(params)

        backend.compile = compile
        self.backend = backend

    def restore(self) -> None:
        self.release.set()
        self.backend.compile = self.original


def test_waiting_for_a_grammar_abort_and_failure(tiny):
    gate = _Gate(tiny)
    try:
        tiny.add_request("slow", [5, 9, 17], greedy(SO(regex="[a-c]{5}")))
        tiny.add_request("dup-check", [5], greedy(max_tokens=3))
        with pytest.raises(ValueError, match="already in use"):
            tiny.add_request("slow", [5], greedy())
        done = {}
        for _ in bounded(lambda: "dup-check" not in done, 100, "the free request did not finish"):
            done.update({o.request_id: o for o in tiny.step() if o.finished})
        assert tiny.core.structured.is_pending("slow") and tiny.has_unfinished_requests()
        tiny.abort_request("slow")
        assert not tiny.has_unfinished_requests()
    finally:
        gate.restore()
    assert tiny.step() == [] and not tiny.take_request_errors()
    # A compile that fails ends the request with the error: LLM.generate-style callers get
    # it from take_request_errors, the engine core as a 400.
    gate = _Gate(tiny, fail="the grammar exploded")
    try:
        core = EngineCoreProc(tiny.core)
        params = greedy(SO(regex="[d-f]{4}"))
        params.output_kind = RequestOutputKind.DELTA
        assert core.add(EngineCoreRequest("boom", [5, 9], params, 0.0)) is None
        assert core.step().errors == [] and tiny.has_unfinished_requests()
        gate.release.set()
        errors = []
        for _ in bounded(lambda: not errors, 100, "no error came back"):
            errors = core.step().errors
        assert [(e.request_id, e.status, e.message) for e in errors] == [("boom", 400, "the grammar exploded")]
        assert not tiny.has_unfinished_requests() and "boom" not in core.live
    finally:
        gate.restore()


def test_llm_generate_raises_for_a_grammar_that_fails(smol):
    gate = _Gate(smol.engine, fail="no such grammar")
    gate.release.set()
    try:
        with pytest.raises(ValueError, match=r"request \d+ \(prompt 1\): no such grammar"):
            smol.generate(["Hi", "Hello"], [greedy(max_tokens=2), greedy(SO(regex="[x-z]{3}"))], use_tqdm=False)
    finally:
        gate.restore()
    assert not smol.engine.has_unfinished_requests()


@register("vpage-test-after-three")
class AfterThree(ReasoningParser):
    """Test format: the reasoning ends once the sequence holds 8 tokens (prompts of 5 here)."""

    def is_reasoning_end(self, token_ids):
        return len(token_ids) >= 8

    def extract_reasoning(self, text):
        return None, text


def test_reasoning_gate_constrains_only_the_answer(tiny_folder, tiny):
    prompt = [5, 9, 17, 33, 41]
    free = run(tiny, [(prompt, greedy(max_tokens=3))], "f")[0].outputs[0].token_ids
    engine = tiny_engine(tiny_folder, reasoning_parser="vpage-test-after-three")
    try:
        so = SO(regex="[0-9]{3}")
        out = run(engine, [(prompt, greedy(so, 30)), (prompt + [1, 2, 3], greedy(so, 30))])
        tokens = out[0].outputs[0].token_ids
        assert tokens[:3] == free  # the reasoning is free
        tok = engine.tokenizer
        assert re.fullmatch("[0-9]{3}", tok.decode(tokens[3:], skip_special_tokens=True))
        # A prompt that already ends the reasoning is constrained from its first token.
        assert re.fullmatch("[0-9]{3}", out[1].outputs[0].text)
    finally:
        engine.shutdown()


def test_unknown_reasoning_parser_fails_at_start(tiny_folder):
    with pytest.raises(ValueError, match="unknown reasoning parser 'no-such-format'.*vpage-test-after-three"):
        tiny_engine(tiny_folder, reasoning_parser="no-such-format")


@pytest.mark.usefixtures("one_torch_thread")
def test_tensor_parallel_matches_one_rank(tiny_folder, tiny):
    requests = [([5, 9, 17], greedy(SO(regex="[a-z]{6}"))),
                ([7, 8], greedy(SO(json=FLAGS, disable_any_whitespace=True), 60)),
                ([11, 12, 13, 14], SamplingParams(temperature=1.0, seed=2, max_tokens=20,
                                                  structured_outputs=SO(choice=["fox", "dog", "café"])))]
    one = [o.outputs[0].token_ids for o in run(tiny, requests, "t1-")]
    engine = tiny_engine(tiny_folder, tensor_parallel_size=2, num_threads=2)
    try:
        two = run(engine, requests, "t2-")
    finally:
        engine.shutdown()
    assert [o.outputs[0].token_ids for o in two] == one
    for (_, params), out in zip(requests, two):
        check(params.structured_outputs, out.outputs[0].text)
