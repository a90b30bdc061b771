"""What a structured-output backend provides: cheap validation, a token-level compile, and
per-sequence matchers that fill rows of the step's token bitmask.

A backend is built once per engine, lazily (its tokenizer tables cost a fraction of a second
to build), over the model's logits width ``vocab_size``, which may exceed the tokenizer's
(padded embeddings: the extra ids are never allowed). Bitmask rows use xgrammar's layout, as
``vpage.ops.apply_token_bitmask_`` does: int32 words, bit ``t % 32`` of word ``t // 32`` set =
token ``t`` allowed.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from vpage.sampling_params import StructuredOutputsParams


class GrammarMatcher(ABC):
    """The state of one sequence within its grammar. Not thread-safe: the engine loop owns it."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advances over ``token``; False when the grammar forbids it (the sequence cannot go on
        within its grammar then). A stop token the grammar allows at its end terminates it."""

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advances over each token in turn; False at the first one the grammar forbids (the
        ones before it stay accepted)."""
        return all(self.accept_token(t) for t in tokens)

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into row ``row`` of ``bitmask`` (int32, CPU,
        ``[rows, token_bitmask_words(vocab_size)]``)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether a stop token ended the grammar (nothing more may be accepted)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the grammar."""


# The whitespace a JSON grammar allows between tokens unless a request says otherwise, as
# llama.cpp's schema grammars do: none, one space, or one newline and an indent of at most 20
# spaces or tabs (a model that loses its way in whitespace cannot run on in it). xgrammar takes
# no pattern: it bounds each run of whitespace to JSON_MAX_WHITESPACE characters instead.
JSON_WHITESPACE_PATTERN = r"(?: |\n[ \t]{0,20})?"
JSON_MAX_WHITESPACE = 21


class StructuredOutputBackend(ABC):
    """A grammar library. ``validate`` needs no tokenizer (the API process may call it);
    ``compile`` runs on a worker thread; ``matcher`` runs on the engine loop."""

    name: str

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    @classmethod
    @abstractmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """Parses the constraint without the token-level compile (milliseconds); ValueError
        naming what is wrong."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (an opaque object that ``matcher`` takes); ValueError when it
        does not compile. Thread-safe."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar."""


# --------------------------------------------------------------------- shared helpers


def schema_of(params: StructuredOutputsParams) -> Any:
    """The JSON schema of a ``json`` constraint as a Python object (text is parsed)."""
    if isinstance(params.json, dict):
        return params.json
    try:
        return json.loads(params.json)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar (xgrammar's dialect) whose root is exactly one of ``choices``. JSON string
    literals are valid EBNF literals (the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def looks_like_lark(grammar: str) -> bool:
    """Lark rules read ``name: ...``; EBNF (GBNF) rules read ``name ::= ...``."""
    return "::=" not in grammar and re.search(r"^\s*[?!]?\w+(\.\d+)?\s*:", grammar, re.MULTILINE) is not None


_LIB_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def library_message(exc: BaseException) -> str:
    """A grammar library's error message without its "[time] file.cc:line:" prefix."""
    return _LIB_PREFIX.sub("", str(exc).strip()).strip()
