"""The deepseek_r1 and qwen3 reasoning parsers: where reasoning ends in token ids (tags as
single tokens, or found in the decoded text), and reasoning/content splits of whole outputs
and of the same outputs streamed in random pieces, after prompts that open, close or say
nothing of a <think> block."""

from __future__ import annotations

import random

import pytest

from vpage.reasoning import get_reasoning_parser, reasoning_parser_names


class TagTokenizer:
    """Characters are tokens (id = code point); with ``tags``, <think> and </think> are single
    tokens too, as in DeepSeek-R1's and Qwen3's vocabularies."""

    TAGS = {"<think>": 1_000_001, "</think>": 1_000_002}

    def __init__(self, tags: bool):
        self.tags = tags

    def get_vocab(self) -> dict[str, int]:
        return dict(self.TAGS) if self.tags else {"a": ord("a")}

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in self.TAGS if self.tags and text.startswith(t, i)), None)
            ids.append(self.TAGS[tag] if tag else ord(text[i]))
            i += len(tag) if tag else 1
        return ids

    def decode(self, ids: list[int]) -> str:
        names = {v: k for k, v in self.TAGS.items()}
        return "".join(names.get(i) or chr(i) for i in ids)


OPEN = "<|im_start|>assistant\n<think>\n"  # the template opened the block
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking=False
PLAIN = "<|im_start|>assistant\n"
HISTORY_CLOSED = "<think>old</think>answer<|im_end|>\n<|im_start|>assistant\n"

# (parser, prompt, output, reasoning, content)
CASES = [
    ("deepseek_r1", PLAIN, "I add 2 and 2.\n</think>\n\n4", "I add 2 and 2.\n", "\n\n4"),
    ("deepseek_r1", PLAIN, "<think>plan</think>answer", "plan", "answer"),
    ("deepseek_r1", PLAIN, "  \n<think>\nplan</think>", "\nplan", None),
    ("deepseek_r1", OPEN, "still thinking, cut short", "still thinking, cut short", None),
    ("deepseek_r1", OPEN, "a </thin b < c </think>done", "a </thin b < c ", "done"),
    ("deepseek_r1", CLOSED, "just the answer", None, "just the answer"),
    ("deepseek_r1", HISTORY_CLOSED, "<think>new</think>reply", "new", "reply"),
    ("deepseek_r1", PLAIN, "</think>", None, None),
    ("qwen3", PLAIN, "no tags at all", None, "no tags at all"),
    ("qwen3", PLAIN, "\n<think>\nstep</think>\n\nresult", "\nstep", "\n\nresult"),
    ("qwen3", PLAIN, "<think>truncated", "truncated", None),
    ("qwen3", PLAIN, "<thinking is not a tag", None, "<thinking is not a tag"),
    ("qwen3", OPEN, "step one</think>result", "step one", "result"),
    ("qwen3", CLOSED, "result </think> text", None, "result </think> text"),
    ("qwen3", CLOSED, "<think>x</think>y", "x", "y"),
    ("qwen3", "", "  ", None, "  "),
]


def test_registered():
    assert {"deepseek_r1", "qwen3"} <= set(reasoning_parser_names())
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize("tags", [True, False], ids=["tag-tokens", "text"])
@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_is_reasoning_end(name, tags):
    tok = TagTokenizer(tags)
    parser = get_reasoning_parser(name)(tok)
    assert (parser.start_token_id is not None) == tags
    for text, ended in [("", False), ("plain prompt", False), (OPEN, False), (CLOSED, True),
                        (OPEN + "thinking", False), (OPEN + "thinking</think>", True),
                        (OPEN + "thinking</think>answer", True), (HISTORY_CLOSED, True),
                        (HISTORY_CLOSED + "<think>again", False), ("a </thin", False)]:
        assert parser.is_reasoning_end(tok.encode(text)) is ended, text


def _stream(parser, prompt_ids, text: str, seed: int) -> tuple[str, str]:
    rng = random.Random(seed)
    reasoning, content, previous, i = "", "", "", 0
    while i < len(text) or i == 0:
        piece = text[i:i + rng.randint(1, 3)]
        i += max(len(piece), 1)
        r, c = parser.extract_reasoning_streaming(previous, piece, prompt_ids, final=i >= len(text))
        previous += piece
        reasoning += r
        content += c
    return reasoning, content


@pytest.mark.parametrize("tags", [True, False], ids=["tag-tokens", "text"])
@pytest.mark.parametrize("name,prompt,output,reasoning,content", CASES)
def test_split_whole_and_streamed(name, prompt, output, reasoning, content, tags):
    tok = TagTokenizer(tags)
    parser = get_reasoning_parser(name)(tok)
    prompt_ids = tok.encode(prompt)
    assert parser.extract_reasoning(output, prompt_ids) == (reasoning, content)
    for seed in range(4):
        assert _stream(parser, prompt_ids, output, seed) == (reasoning or "", content or "")


def test_streaming_holds_back_a_tag_until_decided():
    parser = get_reasoning_parser("deepseek_r1")(TagTokenizer(True))
    assert parser.extract_reasoning_streaming("", "plan </th") == ("plan ", "")
    assert parser.extract_reasoning_streaming("plan </th", "ink>an") == ("", "an")
    qwen = get_reasoning_parser("qwen3")(TagTokenizer(True))
    assert qwen.extract_reasoning_streaming("", " <thi") == ("", "")  # may still open a block
    assert qwen.extract_reasoning_streaming(" <thi", "s is") == ("", " <this is")
    assert qwen.extract_reasoning_streaming("", "x", final=True) == ("", "x")
