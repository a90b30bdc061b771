"""The llguidance backend: Lark (and GBNF) grammars, JSON Schema as llguidance implements it,
regex, choices and legacy structural tags; masks are computed lazily, token by token."""

from __future__ import annotations

import copy
import json
from typing import Any, Sequence

import torch

from vpage.sampling_params import StructuredOutputsParams
from vpage.structured_output.backend import (JSON_WHITESPACE_PATTERN, GrammarMatcher, StructuredOutputBackend,
                                             library_message, schema_of)


def _close_objects(schema: Any) -> None:
    """In place: ``additionalProperties: false`` on every object schema with properties that
    says nothing about them (``disable_additional_properties``)."""
    if isinstance(schema, list):
        for item in schema:
            _close_objects(item)
        return
    if not isinstance(schema, dict):
        return
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    for key, value in schema.items():
        if key not in ("enum", "const", "examples", "default") and isinstance(value, (dict, list)):
            _close_objects(value)


def _schema_with_options(schema: Any, params: StructuredOutputsParams) -> Any:
    """The schema with the request's JSON options: closed objects, and llguidance's
    ``x-guidance`` whitespace settings (unless the schema sets its own)."""
    if params.disable_additional_properties:
        schema = copy.deepcopy(schema)
        _close_objects(schema)
    if not isinstance(schema, dict):
        return schema
    options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
    if not params.disable_any_whitespace:
        options["whitespace_pattern"] = params.whitespace_pattern or JSON_WHITESPACE_PATTERN
    return {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}


def _json_grammar(schema: Any, params: StructuredOutputsParams) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(_schema_with_options(schema, params))


def _structural_tag_grammar(text: str, params: StructuredOutputsParams) -> str:
    import llguidance

    try:
        tag = json.loads(text)
        triggers = list(tag["triggers"])
        tags = []
        for s in tag["structures"]:
            trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"structural_tag: no trigger starts {s['begin']!r} (triggers {triggers})")
            schema = _schema_with_options(s["schema"], params)
            if not isinstance(schema, dict):
                raise ValueError(f"structural_tag: the schema of {s['begin']!r} must be a JSON object")
            tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    except (TypeError, KeyError, json.JSONDecodeError) as e:
        raise ValueError('llguidance takes structural tags as {"structures": [{"begin", "schema", "end"}, ...], '
                         f'"triggers": [...]}} ({type(e).__name__}: {e})') from None
    if not tags:
        raise ValueError("structural_tag has no structures")
    return llguidance.StructTag.to_grammar(tags)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON serialization) of a constraint; ValueError when the
    constraint cannot be expressed."""
    import llguidance

    kind = params.kind
    try:
        if kind == "json":
            return _json_grammar(schema_of(params), params)
        if kind == "json_object":
            return _json_grammar({"type": "object"}, params)
        if kind == "structural_tag":
            return _structural_tag_grammar(params.structural_tag, params)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(params.choice))
        return llguidance.grammar_from(kind, getattr(params, kind))  # regex; grammar: Lark or GBNF
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 -- llguidance raises several types for bad input
        raise ValueError(f"invalid structured_outputs.{kind}: {library_message(e)}") from None


class LLGuidanceBackend(StructuredOutputBackend):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance.hf

        super().__init__(tokenizer, vocab_size, eos_token_ids)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                         eos_token=self.eos_token_ids or None)

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar_text(params), None)
        if error:
            raise ValueError(f"invalid structured_outputs.{params.kind}: {error.strip()}")

    def compile(self, params: StructuredOutputsParams) -> Any:
        import llguidance

        # llguidance builds its lexer here and the parser's tables as tokens arrive; matchers of
        # the same grammar are copies of this one.
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(params), log_level=0)
        error = template.get_error()
        if error:
            raise ValueError(f"structured_outputs.{params.kind} does not compile: {error.strip()}")
        return template

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self.eos_token_ids)


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: Any, eos_token_ids: Sequence[int]):
        self._matcher = matcher
        self._eos = frozenset(eos_token_ids)
        self._terminated = False
        # llguidance takes a stop token without recording it once the grammar has stopped
        # (nothing else allowed), so a rollback over that token undoes one token less.
        self._eos_unrecorded = False

    def accept_token(self, token: int) -> bool:
        if self._terminated:
            return False
        stopped = self._matcher.is_stopped()
        if not self._matcher.consume_token(token):
            return False
        if token in self._eos:
            self._terminated, self._eos_unrecorded = True, stopped
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self._terminated:  # the stop token is the last one accepted
            num_tokens -= self._eos_unrecorded
            self._terminated = self._eos_unrecorded = False
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def reset(self) -> None:
        self._matcher.reset()
        self._terminated = self._eos_unrecorded = False
