"""The xgrammar backend (the default): JSON Schema, regex, EBNF grammars, choices and
structural tags, compiled to per-token masks ahead of time."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch

from vpage.sampling_params import StructuredOutputsParams
from vpage.structured_output.backend import (JSON_MAX_WHITESPACE, GrammarMatcher, StructuredOutputBackend,
                                             choice_ebnf, library_message, looks_like_lark, schema_of)

# String formats xgrammar's JSON Schema converter turns into grammar (others it ignores).
_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
            "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
# Keywords xgrammar accepts but does not enforce: output could break the schema unnoticed.
_IGNORED = ("multipleOf", "contains", "minContains", "maxContains", "not")
_SUGGEST = "; --structured-outputs-backend llguidance may support it"


def _unenforced(schema: Any, path: str = "#") -> str | None:
    """The first keyword of ``schema`` xgrammar would silently ignore, as "keyword at path"."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found = _unenforced(item, f"{path}/{i}")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key in _IGNORED:
        if key in schema and not (key == "not" and not isinstance(schema[key], dict)):
            return f"{key!r} at {path}"
    if schema.get("uniqueItems") is True:
        return f"'uniqueItems' at {path}"
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in _FORMATS and schema.get("type") in ("string", None):
        return f"format {fmt!r} at {path}"
    if ("pattern" in schema or "format" in schema) and ("minLength" in schema or "maxLength" in schema):
        return f"minLength/maxLength with a pattern or format at {path}"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"'allOf' of several schemas at {path}"
    for key, value in schema.items():
        if key in ("enum", "const", "examples", "default"):
            continue  # values, not schemas
        if isinstance(value, (dict, list)):
            found = _unenforced(value, f"{path}/{key}")
            if found:
                return found
    return None


def _structural_tag_args(text: str) -> tuple[tuple, dict]:
    """``compile_structural_tag`` / ``Grammar.from_structural_tag`` arguments for a structural
    tag: the legacy ``{"structures": [...], "triggers": [...]}`` shape, or xgrammar's own JSON."""
    import xgrammar as xgr

    try:
        tag = json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
    if isinstance(tag, dict) and "structures" in tag:
        try:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return (items, list(tag["triggers"])), {}
        except (KeyError, TypeError) as e:
            raise ValueError(f"structural_tag: each structure needs begin, schema and end, and the tag needs "
                             f"triggers ({type(e).__name__}: {e})") from None
    return (text,), {}


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        import xgrammar as xgr

        super().__init__(tokenizer, vocab_size, eos_token_ids)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=self.eos_token_ids or None)
        # xgrammar's own cache stays off: the compiler's LRU above keeps the compiled grammars.
        self.compiler = xgr.GrammarCompiler(info, max_threads=max(1, min(8, (os.cpu_count() or 2) // 2)),
                                            cache_enabled=False)

    @staticmethod
    def _json_options(params: StructuredOutputsParams) -> dict:
        return {"any_whitespace": not params.disable_any_whitespace,
                "max_whitespace_cnt": None if params.disable_any_whitespace else JSON_MAX_WHITESPACE,
                "strict_mode": params.disable_additional_properties}

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        if params.whitespace_pattern is not None:
            raise ValueError("xgrammar does not take a whitespace_pattern (use disable_any_whitespace, or "
                             "--structured-outputs-backend llguidance)")
        kind = params.kind
        try:
            if kind == "json":
                schema = schema_of(params)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("structured_outputs.json must be a JSON schema object, got "
                                     f"{type(schema).__name__}")
                unenforced = _unenforced(schema)
                if unenforced:
                    raise ValueError(f"xgrammar does not enforce {unenforced} of the JSON schema{_SUGGEST}")
                xgr.Grammar.from_json_schema(json.dumps(schema), **cls._json_options(params))
            elif kind == "regex":
                if "\x00" in params.regex:
                    raise ValueError("structured_outputs.regex contains a NUL character")
                xgr.Grammar.from_regex(params.regex)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
            elif kind == "grammar":
                if looks_like_lark(params.grammar):
                    raise ValueError("xgrammar takes EBNF grammars (rule ::= ...); this looks like a Lark grammar: "
                                     "use --structured-outputs-backend llguidance")
                xgr.Grammar.from_ebnf(params.grammar)
            elif kind == "structural_tag":
                args, kwargs = _structural_tag_args(params.structural_tag)
                xgr.Grammar.from_structural_tag(*args, **kwargs)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 -- xgrammar raises RuntimeError and others for bad input
            raise ValueError(f"invalid structured_outputs.{kind}: {library_message(e)}") from None

    def compile(self, params: StructuredOutputsParams) -> Any:
        kind = params.kind
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(json.dumps(schema_of(params)), **self._json_options(params))
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', **self._json_options(params))
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                return self.compiler.compile_grammar(choice_ebnf(params.choice))
            if kind == "grammar":
                return self.compiler.compile_grammar(params.grammar)
            args, kwargs = _structural_tag_args(params.structural_tag)
            return self.compiler.compile_structural_tag(*args, **kwargs)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"structured_outputs.{kind} does not compile: {library_message(e)}") from None

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return XgrammarMatcher(compiled)


class XgrammarMatcher(GrammarMatcher):
    def __init__(self, compiled: Any):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def reset(self) -> None:
        self._matcher.reset()
