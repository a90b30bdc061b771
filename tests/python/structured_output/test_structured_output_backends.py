"""The structured-output backends on their own (no engine): each bitmask row is exactly the
set of tokens the matcher accepts (brute force over a vocabulary wider than the tokenizer's),
rollback and reset restore it, stop tokens terminate; validation names what is wrong without
a tokenizer; the compiler shares and caches compiles."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from model_fixtures import save_tiny_tokenizer
from vpage import SamplingParams, ops
from vpage.sampling_params import StructuredOutputsParams as SO
from vpage.structured_output import BACKENDS, StepBitmask, StructuredOutputCompiler, grammar_key, \
    validate_structured_outputs

VOCAB = 400  # the model's logits width; the tiny tokenizer has 320 tokens
EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert len(tok) < VOCAB
    return tok


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def backend(request, tokenizer):
    return BACKENDS[request.param](tokenizer, VOCAB, [EOS])


def allowed(mask: torch.Tensor, row: int = 0) -> set[int]:
    bits = (mask[row, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.reshape(-1)[:VOCAB]).reshape(-1).tolist())


def accepted(backend, compiled, history: list[int], tokens) -> set[int]:
    """Which of ``tokens`` a fresh matcher accepts after ``history``, tried one by one."""
    out = set()
    for t in tokens:
        probe = backend.matcher(compiled)
        assert probe.accept_tokens(history)
        if probe.accept_token(t):
            out.add(t)
    return out


def fill(matcher) -> set[int]:
    mask = torch.zeros((2, ops.token_bitmask_words(VOCAB)), dtype=torch.int32)
    matcher.fill_bitmask(mask, 1)
    assert not mask[0].any()  # only its own row
    return allowed(mask, 1)


@pytest.mark.parametrize("so", [SO(regex=r"(ab|c)[0-9]{1,2}e"), SO(regex="[0-9]{1,3}"),
                                SO(choice=["fox", "dog", "café"]),
                                SO(json={"type": "object", "properties": {"a": {"type": "boolean"}},
                                         "required": ["a"], "additionalProperties": False},
                                   disable_any_whitespace=True)],
                         ids=["regex", "open-regex", "choice", "json"])
def test_bitmask_is_what_the_matcher_accepts(backend, tokenizer, so):
    compiled = backend.compile(so)
    matcher, twin = backend.matcher(compiled), backend.matcher(compiled)
    rng = random.Random(7)
    history, masks = [], []
    while not matcher.is_terminated():
        mask = fill(matcher)
        # xgrammar allows every token that keeps the text in the grammar; llguidance may leave
        # out some (its masks skip a few non-canonical splits of a forced string).
        if backend.name == "xgrammar":
            assert mask == accepted(backend, compiled, history, range(VOCAB))
        else:
            assert mask == accepted(backend, compiled, history, mask)
        assert mask and max(mask) < len(tokenizer)  # never an id past the tokenizer's
        masks.append(mask)
        token = rng.choice(sorted(mask))
        assert matcher.accept_token(token)
        history.append(token)
        assert len(history) < 40
    assert history[-1] == EOS
    text = tokenizer.decode(history[:-1])
    if so.kind == "regex":
        assert re.fullmatch(so.regex, text), text
    elif so.kind == "choice":
        assert text in so.choice
    else:
        assert json.loads(text) in ({"a": True}, {"a": False})
    # The twin never moved: matchers of one compiled grammar are independent.
    assert fill(twin) == masks[0]
    # Rolling back k tokens gives back the mask of that point; the stop token too.
    for k in (1, 3, len(history)):
        k = min(k, len(history))
        matcher.rollback(k)
        assert not matcher.is_terminated()
        assert fill(matcher) == masks[len(history) - k]
        assert matcher.accept_tokens(history[len(history) - k:])
        assert matcher.is_terminated()
    matcher.reset()
    assert not matcher.is_terminated() and fill(matcher) == masks[0]
    assert not matcher.accept_token(len(tokenizer) + 5)  # outside the tokenizer


def test_step_bitmask_fills_only_active_rows(backend):
    from vpage.structured_output import SequenceConstraint

    compiled = backend.compile(SO(regex="[0-9]+"))
    a = SequenceConstraint(backend.matcher(compiled), [1], [])
    b = SequenceConstraint(backend.matcher(compiled), [1], [])
    step = StepBitmask(VOCAB, max_rows=2)
    assert step.build([None, None]) is None
    mask = step.build([None, a, None, b])  # more rows than it was sized for
    assert mask.shape == (4, ops.token_bitmask_words(VOCAB)) and mask.dtype == torch.int32
    assert (mask[0] == -1).all() and (mask[2] == -1).all()
    assert allowed(mask, 1) == allowed(mask, 3) == fill(backend.matcher(compiled))


def test_reasoning_gate_starts_the_grammar_after_the_end(backend):
    from vpage.structured_output import SequenceConstraint

    class EndsAt:
        def is_reasoning_end(self, ids):
            return 99 in ids

    output: list[int] = []
    gate = SequenceConstraint(backend.matcher(backend.compile(SO(choice=["a"]))), [5, 6], output, EndsAt())
    for token in (7, 8):
        assert not gate.active
        output.append(token)
        assert not gate.accept(token)  # free: anything goes
    output.append(99)
    assert not gate.accept(99) and gate.active  # the end marker itself is free
    assert SequenceConstraint(backend.matcher(backend.compile(SO(choice=["a"]))), [99], [], EndsAt()).active


@pytest.mark.parametrize("backend_name,so,reason", [
    ("xgrammar", SO(json={"type": "foo"}), "Unsupported type"),
    ("xgrammar", SO(json='{"type": '), "not valid JSON"),
    ("xgrammar", SO(json={"type": "integer", "multipleOf": 3}), "multipleOf"),
    ("xgrammar", SO(json={"type": "string", "format": "color"}), "format 'color'"),
    ("xgrammar", SO(regex="a(b"), "parenthesis"),
    ("xgrammar", SO(grammar='root ::= "a" b'), 'Rule "b" is not defined'),
    ("xgrammar", SO(grammar='start: "a" | "b"'), "llguidance"),
    ("xgrammar", SO(json_object=True, whitespace_pattern=" ?"), "whitespace_pattern"),
    ("xgrammar", SO(structural_tag='{"structures": [{"begin": "<a>"}], "triggers": ["<a"]}'), "begin, schema"),
    ("llguidance", SO(json={"type": "foo"}), "foo"),
    ("llguidance", SO(json={"not": {"type": "string"}}), "not"),
    ("llguidance", SO(regex="a(b"), "unclosed group"),
    ("llguidance", SO(grammar='start: "a" b'), "unknown name"),
])
def test_validation_names_the_reason(backend_name, so, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        validate_structured_outputs(SamplingParams(structured_outputs=so), backend_name)


@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
def test_valid_constraints_pass_validation(backend_name):
    grammar = 'root ::= "yes" | "no"' if backend_name == "xgrammar" else 'start: "yes" | "no"'
    for so in (SO(json={"type": "object", "properties": {"a": {"type": "integer", "minimum": 3}}}),
               SO(json='{"type": "array", "items": {"type": "string"}, "maxItems": 2}'), SO(json_object=True),
               SO(regex=r"\d{3}"), SO(choice=['say "hi"', "é\n"]), SO(grammar=grammar),
               SO(structural_tag='{"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], '
                                 '"triggers": ["<f"]}')):
        validate_structured_outputs(SamplingParams(structured_outputs=so), backend_name)
    with pytest.raises(ValueError, match="unknown structured outputs backend"):
        validate_structured_outputs(SamplingParams(structured_outputs=SO(json_object=True)), "outlines")


def test_beam_search_with_structured_outputs_is_refused():
    params = SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, structured_outputs=SO(regex="a+"))
    with pytest.raises(ValueError, match="beam search"):
        validate_structured_outputs(params)


def test_compiler_shares_and_caches_compiles(tokenizer):
    compiler = StructuredOutputCompiler("xgrammar", tokenizer, VOCAB, [EOS], cache_size=2)
    try:
        one = compiler.submit(SO(json={"type": "object", "required": ["a"], "properties": {"a": {}}}))
        same = compiler.submit(SO(json={"properties": {"a": {}}, "required": ["a"], "type": "object"}))
        assert one is same and compiler.stats.cache_hits == 1
        assert compiler.submit(SO(json_object=True, disable_any_whitespace=True)) is not \
            compiler.submit(SO(json_object=True))  # options are part of the key
        assert compiler.submit(SO(regex="a")).result(timeout=60) is not None  # evicts the oldest
        assert compiler.submit(SO(json={"type": "object", "required": ["a"], "properties": {"a": {}}})) is not one
        assert compiler.stats.compiles >= 3 and compiler.stats.compile_seconds > 0
        assert grammar_key(SO(choice=["a", "b"])) != grammar_key(SO(choice=["b", "a"]))
    finally:
        compiler.shutdown()


def test_structural_tag_constrains_only_the_tagged_parts(backend, tokenizer):
    tag = json.dumps({"structures": [{"begin": "<f>", "end": "</f>", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}], "triggers": ["<f"]})
    compiled = backend.compile(SO(structural_tag=tag))
    good = backend.matcher(compiled)
    assert good.accept_tokens(tokenizer.encode('hi <f>{"a": 12}</f> bye')) and good.accept_token(EOS)
    assert good.is_terminated()
    bad = backend.matcher(compiled)
    ids = tokenizer.encode('hi <f>{"a": "x"')  # a string where the schema wants an integer
    assert not all(bad.accept_token(t) for t in ids)


def _accepts(backend, tokenizer, so: SO, text: str) -> bool:
    """Whether a fresh matcher of ``so`` takes ``text`` (as the tokenizer splits it) and may end."""
    matcher = backend.matcher(backend.compile(so))
    return matcher.accept_tokens(tokenizer.encode(text)) and matcher.accept_token(EOS)


def test_json_is_strict_and_its_whitespace_bounded_by_default(backend, tokenizer):
    # Strict unless asked: no key the schema does not name (OpenAI's strict, xgrammar's default),
    # unless disable_additional_properties=False or the schema opens the object itself.
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = '{"a": 1, "b": 2}'
    assert _accepts(backend, tokenizer, SO(json=schema), '{"a": 1}')
    assert not _accepts(backend, tokenizer, SO(json=schema), extra)
    assert _accepts(backend, tokenizer, SO(json=schema, disable_additional_properties=False), extra)
    assert _accepts(backend, tokenizer, SO(json={**schema, "additionalProperties": True}), extra)
    # Whitespace: an indented layout passes, a run past the bound (llama.cpp's: one newline and
    # an indent of at most 20) does not; disable_any_whitespace allows none.
    assert _accepts(backend, tokenizer, SO(json=schema), '{\n' + ' ' * 20 + '"a": 1\n}')
    assert not _accepts(backend, tokenizer, SO(json=schema), '{' + '\n' * 30 + '"a": 1}')
    assert not _accepts(backend, tokenizer, SO(json=schema), '{' + ' ' * 30 + '"a": 1}')
    assert not _accepts(backend, tokenizer, SO(json=schema, disable_any_whitespace=True), '{ "a": 1}')
