"""Incremental detokenization and stop strings, with the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from vpage.model_executor.loader.default_model import default_model_path
from vpage.tokenizer import IncrementalDetokenizer, StopStringMatcher, get_tokenizer

TEXTS = [
    "Hello world, this is a test.",
    "  leading spaces and\ttabs\nnew lines",
    "héllo wörld — naïve café 日本語のテキスト 🎉🚀 done",
    "def f(x):\n    return x ** 2  # squared",
]


@pytest.fixture(scope="module")
def tokenizer():
    path = default_model_path()
    return get_tokenizer(path.parent, path.name)


def stream(tokenizer, prompt_ids, ids, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    return detok, [detok.add_token(t) for t in ids]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "Question: say something."])
def test_deltas_add_up_to_full_decode(tokenizer, text, prompt):
    prompt_ids = tokenizer.encode(prompt) if prompt else []
    ids = tokenizer.encode(text)
    detok, deltas = stream(tokenizer, prompt_ids, ids)
    full = tokenizer.decode(prompt_ids + ids)
    assert "".join(deltas) == full[len(tokenizer.decode(prompt_ids)) :]
    assert all("\ufffd" not in d for d in deltas)
    assert len(detok.token_ids) <= 8  # a bounded window, however long the text


def test_detokenizer_state_stays_bounded_over_a_long_output(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 200)
    detok, deltas = stream(tokenizer, tokenizer.encode("Long prompt " * 50), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert len(detok.token_ids) <= 8


def test_multibyte_character_split_over_tokens_is_held_back(tokenizer):
    ids = tokenizer.encode(" 🎉")
    assert len(ids) > 1  # byte-level BPE splits the emoji over several tokens
    _, deltas = stream(tokenizer, tokenizer.encode("Party"), ids)
    assert deltas == [""] * (len(ids) - 1) + [" 🎉"]


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("Hi there") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    _, deltas = stream(tokenizer, [], ids, skip_special_tokens=True)
    assert "".join(deltas) == "Hi there"
    _, deltas = stream(tokenizer, [], ids, skip_special_tokens=False)
    assert "".join(deltas) == "Hi there<|im_end|>"


def test_stop_string_across_deltas():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc S") == "abc "  # "S" could start the stop string: held back
    assert m.feed("TO") == ""
    assert m.feed("P and more") == ""
    assert m.stopped and m.stop_str == "STOP" and m.flush() == ""


def test_stop_string_included():
    m = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    streamed = m.feed("abc ST") + m.feed("OP tail")
    assert streamed == "abc STOP" and m.flush() == ""


def test_false_partial_match_is_released():
    m = StopStringMatcher(["</end>", "xyz"])
    assert m.feed("a </e") == "a "
    assert m.feed("x") == "</e"  # "</ex" is no prefix of "</end>"; "x" may start "xyz"
    assert m.feed("tra") == "xtra"
    assert m.flush() == "" and not m.stopped


def test_earliest_stop_wins_and_flush_releases_tail():
    m = StopStringMatcher(["world", "lo w"])
    assert m.feed("hello world") == "hel"
    assert m.stop_str == "lo w"
    m = StopStringMatcher(["\n\n"])
    assert m.feed("line\n") == "line"
    assert m.flush() == "\n" and m.flush() == ""


def test_stop_strings_with_real_tokens(tokenizer):
    ids = tokenizer.encode("The answer is 42. The End of story")
    detok = IncrementalDetokenizer(tokenizer, [])
    stop = StopStringMatcher([". The E"])
    streamed = ""
    for t in ids:
        streamed += stop.feed(detok.add_token(t))
        if stop.stopped:
            break
    assert streamed == "The answer is 42"


class _PlainTokenizer:
    """The same tokenizer seen only through ``decode`` (the detokenizer's generic path)."""

    def __init__(self, tokenizer):
        self._inner = tokenizer

    def decode(self, ids, **kwargs):
        return self._inner.decode(ids, **kwargs)


@pytest.mark.parametrize("skip", [True, False])
def test_backend_decode_path_equals_transformers_decode(tokenizer, skip):
    """The detokenizer decodes through the Rust tokenizer directly; its deltas must equal those
    of transformers' own decode, special tokens and split UTF-8 characters included."""
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for text in TEXTS:
        ids = tokenizer.encode(text)
        ids = ids[:3] + [special] + ids[3:] + [special]
        prompt = tokenizer.encode("Question:")
        fast = IncrementalDetokenizer(tokenizer, prompt, skip)
        assert fast._decode.__name__ == "<lambda>"  # the backend path is in use
        slow = IncrementalDetokenizer(_PlainTokenizer(tokenizer), prompt, skip)
        assert [fast.add_token(t) for t in ids] == [slow.add_token(t) for t in ids]


def test_no_stop_strings_streams_every_delta():
    m = StopStringMatcher([])
    assert [m.feed(d) for d in ["a", "", "bc S", "TOP"]] == ["a", "", "bc S", "TOP"]
    assert m.flush() == "" and not m.stopped
