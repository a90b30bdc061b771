"""Per-request sampling settings, with vLLM's field names and validation."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput of a request carries (vLLM's names).

    CUMULATIVE: everything generated so far, every step the request advances; DELTA: only what
    the step added (new text, token ids, logprobs), the finish reason once; FINAL_ONLY: one
    output, when the request finishes. Requests whose answers are chosen at the end (beam
    search, best_of > n) report only when they finish under DELTA and FINAL_ONLY."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    """How the sampler picks tokens for a request."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    BEAM = 3


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's names); exactly one of ``json``
    (a JSON schema, as a dict or its text), ``regex``, ``choice`` (one of these strings),
    ``grammar`` (EBNF, or Lark for llguidance), ``json_object`` (any JSON object) or
    ``structural_tag`` (xgrammar's structural tag, as JSON text) is set.

    JSON is strict by default (OpenAI's ``strict``, xgrammar's default): objects of a schema that
    says nothing about additionalProperties accept no other keys, unless
    ``disable_additional_properties=False``. Whitespace between JSON tokens is bounded by default
    (``structured_output.backend.JSON_WHITESPACE_PATTERN``: at most one newline and 20 spaces or
    tabs, as llama.cpp's schema grammars allow); ``disable_any_whitespace`` allows none,
    ``whitespace_pattern`` (llguidance) sets its own."""

    json: Union[str, dict, None] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = True
    whitespace_pattern: Optional[str] = None

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("structured outputs need exactly one of json, regex, choice, grammar, json_object "
                             f"or structural_tag, got {kinds or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r}")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar", "json_object" or "structural_tag"."""
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                    if getattr(self, name) not in (None, False))


@dataclass
class SamplingParams:
    """Sampling settings of one request; invalid combinations raise ValueError.

    temperature 0 means greedy; top_k 0 or -1 and top_p 1 and min_p 0 mean "off".
    ``best_of`` defaults to ``n``; with beam search it is the beam width.
    ``prompt_logprobs``: the top-k logprobs of every prompt token after the first (and the
    prompt token's own); ``logit_bias``: token id -> value added to its logit; ``allowed_token_ids``:
    only these may be sampled; ``bad_words``: words (each as it tokenizes alone and after a
    space) that are never completed; ``structured_outputs``: a grammar the output must match.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._verify_args()
        if self.use_beam_search:
            self._verify_beam_search()
        else:
            self._verify_non_beam_search()
            if self.temperature < _GREEDY_EPS:
                self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0
                self._verify_greedy_sampling()

    def _verify_args(self) -> None:
        def check(ok: bool, msg: str) -> None:
            """Raise ValueError(msg) unless ok."""
            if not ok:
                raise ValueError(msg)

        check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}")
        check(isinstance(self.best_of, int) and self.best_of >= self.n,
              f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}")
        check(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(0.0 < self.repetition_penalty <= 2.0,
              f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
              f"top_k must be -1 or 0 (disable), or at least 1, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.seed is None or isinstance(self.seed, int), f"seed must be an int or None, got {self.seed!r}")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              f"max_tokens must be at least 1, got {self.max_tokens}")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
              f"min_tokens must be greater than or equal to 0, got {self.min_tokens}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
              f"logprobs must be non-negative, got {self.logprobs}")
        check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
              f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              f"structured_outputs must be StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
        self._verify_token_controls()
        check(all(isinstance(s, str) and s for s in self.stop),
              f"stop strings must be non-empty strings, got {self.stop!r}")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        check(self.output_kind in tuple(RequestOutputKind),
              f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self.output_kind = RequestOutputKind(self.output_kind)

    def _verify_token_controls(self) -> None:
        """Types of logit_bias (token id -> finite bias), allowed_token_ids (a non-empty list of
        ids) and bad_words (non-empty strings); the vocabulary is checked by verify_token_ids."""
        def is_id(t: object) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and t >= 0

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    is_id(t) and isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b)
                    for t, b in self.logit_bias.items()):
                raise ValueError(f"logit_bias must map token ids (non-negative ints) to finite numbers, "
                                 f"got {self.logit_bias!r:.200}")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not all(map(is_id, self.allowed_token_ids)):
                raise ValueError(f"allowed_token_ids must be a list of token ids (non-negative ints), "
                                 f"got {self.allowed_token_ids!r:.200}")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is empty: no token could be generated")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r:.200}")
            self.bad_words = list(self.bad_words)
        if self.use_beam_search and (self.logit_bias or self.allowed_token_ids or self.bad_words):
            raise ValueError("logit_bias, allowed_token_ids and bad_words are not supported with beam search")

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenizes ``bad_words`` (the engine calls this when it adds the request): each word
        as it is written at the start of a text and, when that tokenizes differently, after a
        space (a word inside a text); ``bad_words_token_ids`` holds the results."""
        self._bad_words_token_ids = []
        for word in self.bad_words or []:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in self._bad_words_token_ids:
                    self._bad_words_token_ids.append(ids)

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """The token sequences of ``bad_words`` (empty until ``update_from_tokenizer``)."""
        return getattr(self, "_bad_words_token_ids", [])

    def verify_token_ids(self, vocab_size: int) -> None:
        """ValueError naming the field and the ids of logit_bias, allowed_token_ids or the
        tokenized bad_words that are outside a vocabulary of ``vocab_size`` tokens."""
        bad = out_of_vocab(self, vocab_size)
        if bad is not None:
            name, ids = bad
            raise ValueError(f"token id(s) {ids} in {name} are out of the vocabulary (size {vocab_size})")

    def _verify_beam_search(self) -> None:
        if self.best_of == 1:
            raise ValueError(f"best_of must be greater than 1 when using beam search, got {self.best_of}")
        if self.temperature > _GREEDY_EPS:
            raise ValueError("temperature must be 0 when using beam search")
        if self.top_p < 1.0 - _GREEDY_EPS:
            raise ValueError("top_p must be 1 when using beam search")
        if self.top_k != -1:
            raise ValueError("top_k must be -1 (or 0) when using beam search")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False, or 'never', got {self.early_stopping!r}")

    def _verify_non_beam_search(self) -> None:
        if self.early_stopping is not False:
            raise ValueError("early_stopping is not effective and must be False when not using beam search")
        if not (1.0 - _GREEDY_EPS <= self.length_penalty <= 1.0 + _GREEDY_EPS):
            raise ValueError("length_penalty is not effective and must be 1.0 when not using beam search")

    def _verify_greedy_sampling(self) -> None:
        if self.best_of > 1:
            raise ValueError(f"best_of must be 1 when using greedy sampling, got {self.best_of}")

    @property
    def sampling_type(self) -> SamplingType:
        """BEAM, GREEDY (temperature 0), RANDOM_SEED (seed set) or RANDOM."""
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM


def out_of_vocab(params: SamplingParams, vocab_size: int) -> Optional[tuple[str, list[int]]]:
    """The first of logit_bias, allowed_token_ids and bad_words (once tokenized) that holds
    ids outside ``[0, vocab_size)``, with those ids (at most 10); None when all are inside."""
    fields = (("logit_bias", list(params.logit_bias or ())), ("allowed_token_ids", params.allowed_token_ids or []),
              ("bad_words", [t for ids in params.bad_words_token_ids for t in ids]))
    for name, ids in fields:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            return name, bad[:10]
    return None
