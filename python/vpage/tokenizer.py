"""Tokenizer loading, incremental detokenization and stop-string matching."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

# Tokens decoded before the unread ones, so that a token's leading space or merged
# bytes decode the same as in the full text.
_CONTEXT_TOKENS = 6


def get_tokenizer(folder: str | Path, gguf_file: str | None = None, config: Any = None) -> Any:
    """A transformers tokenizer from a local model folder, or from a GGUF file inside it.

    ``config``: the model's transformers config, which picks a GGUF file's tokenizer class
    as AutoTokenizer would (AutoTokenizer itself rebuilds the config from the file with
    gguf-py's reader, seconds for a large vocabulary). Never downloads. Raises ValueError
    naming the path when it cannot be loaded.
    """
    from transformers import AutoTokenizer

    where = Path(folder) / gguf_file if gguf_file else Path(folder)
    try:
        cls = AutoTokenizer
        if gguf_file and config is not None and not (Path(folder) / "tokenizer_config.json").is_file():
            cls = _gguf_tokenizer_class(config) or AutoTokenizer
        return cls.from_pretrained(str(folder), gguf_file=gguf_file, local_files_only=True)
    except Exception as e:  # transformers raises many types for bad or missing files
        raise ValueError(f"{where}: cannot load tokenizer ({type(e).__name__}: {e})") from e


def _gguf_tokenizer_class(config: Any) -> type | None:
    """AutoTokenizer's choice for a GGUF file of this config's model type (a file carries
    no tokenizer class name): the class registered for the config, else TokenizersBackend.
    None with transformers 4, which has no TokenizersBackend (AutoTokenizer then decides)."""
    try:
        from transformers import TokenizersBackend
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    except ImportError:
        return None

    registered = TOKENIZER_MAPPING[type(config)] if type(config) in TOKENIZER_MAPPING else None
    if registered is None or registered.__name__ == "MistralCommonBackend":  # needs Mistral's own files
        return TokenizersBackend
    return registered


def _backend_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
    straight through the Rust ``tokenizers.Tokenizer`` of a transformers fast tokenizer, which
    is all that call does for one that overrides neither ``decode`` nor ``_decode`` (skipping
    transformers' per-call argument conversion, ~2/3 of its cost). None for other tokenizers."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (not isinstance(tokenizer, PreTrainedTokenizerFast) or not callable(getattr(backend, "decode", None))
            or cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode):
        return None
    decode = backend.decode
    return lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one token at a time.

    Each call decodes a small window (a few earlier tokens plus the unread ones) and emits
    only the new characters, so leading spaces and UTF-8 characters split over several
    byte tokens come out right; an incomplete character (U+FFFD at the end) is held back
    until the tokens that complete it arrive.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only the last _CONTEXT_TOKENS prompt tokens are ever decoded again.
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._read_offset = len(self.token_ids)
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
        self._decode = _backend_decoder(tokenizer, skip_special_tokens) or self._decode_slow

    def _decode_slow(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (may be empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        # Forget the tokens no later window reads, so memory and slicing stay constant.
        del self.token_ids[:max(len(self.token_ids) - _CONTEXT_TOKENS, self._read_offset)]
        self._read_offset = len(self.token_ids)
        self._prefix_offset = 0
        return delta


class StopStringMatcher:
    """Finds stop strings in streamed text, even when one spans several deltas.

    ``feed`` returns the text that is safe to stream: on a match the text is cut before the
    stop string (or after it with ``include_stop_str_in_output``); otherwise a tail that
    could still grow into a stop string is held back until it can be decided. Only that
    held-back tail is kept (a match always starts inside it or in the new delta), so each
    feed costs the delta and the stop strings' lengths, not the text so far.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_str: str | None = None  # the stop string that matched, if any
        self._held = ""  # text not streamed yet: a tail that may begin a stop string

    @property
    def stopped(self) -> bool:
        """True once a stop string has matched; later feeds are ignored."""
        return self.stop_str is not None

    def feed(self, delta: str) -> str:
        """Add a text delta; return the newly streamable text (possibly empty)."""
        if self.stopped or not delta:
            return ""
        if not self.stop:  # nothing to match or hold back
            return delta
        text = self._held + delta
        match = self._earliest_match(text)
        if match is not None:
            index, stop_str = match
            self.stop_str = stop_str
            self._held = ""
            return text[: index + len(stop_str) if self.include_stop_str_in_output else index]
        keep = self._partial_match_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """Return the held-back text (call when generation ends for another reason)."""
        out, self._held = self._held, ""
        return out

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        found = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        return min(found, default=None, key=lambda m: (m[0], -len(m[1])))

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
