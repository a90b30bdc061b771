"""Reasoning written between ``<think>`` and ``</think>``: the ``deepseek_r1`` and ``qwen3`` parsers.

Where the reasoning starts depends on the chat template as much as on the model:

- the output opens a block itself with ``<think>`` (after optional whitespace, which is dropped);
- the prompt left a block open (the template ends the generation prompt with ``<think>``);
- the prompt closed one (``enable_thinking=False`` templates write an empty ``<think></think>``
  into the prompt): the output is all content.

An output that opens no block is reasoning for ``deepseek_r1`` unless the prompt closed it
(R1's template puts ``<think>`` in the prompt), and content for ``qwen3`` unless the prompt left a
block open. Reasoning runs to the first ``</think>`` (or to the end of a truncated output), the
content is what follows. Tags are found by token id when the tokenizer has them as single tokens,
otherwise in the decoded text.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from vpage.reasoning import ReasoningParser, register

_START, _END = "<think>", "</think>"


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThinkReasoningParser(ReasoningParser):
    """``<think>``/``</think>`` reasoning; subclasses say what an output that opens no block is."""

    # Whether an output that opens no block starts in reasoning when the prompt has no tag.
    implicit_start = False

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        vocab = tokenizer.get_vocab()
        self.start_token_id: Optional[int] = vocab.get(_START)
        self.end_token_id: Optional[int] = vocab.get(_END)

    def _last_tag(self, token_ids: Sequence[int]) -> Optional[str]:
        """``<think>`` or ``</think>``, whichever comes last in ``token_ids``; None for neither."""
        if self.start_token_id is not None and self.end_token_id is not None:
            for token in reversed(token_ids):
                if token == self.end_token_id:
                    return _END
                if token == self.start_token_id:
                    return _START
            return None
        if not len(token_ids):
            return None
        text = self.tokenizer.decode(list(token_ids))
        start, end = text.rfind(_START), text.rfind(_END)  # neither tag is part of the other
        if start == end:
            return None
        return _END if end > start else _START

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        return self._last_tag(token_ids) == _END

    def _implicit(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether an output that opens no block is reasoning, after this prompt."""
        last = self._last_tag(prompt_token_ids)
        return last == _START or (last is None and self.implicit_start)

    @staticmethod
    def _split(text: str, implicit: bool, partial: bool) -> tuple[str, str]:
        """(reasoning, content) of ``text``. ``partial``: more text may follow, so a tail that
        could still become a tag (or decide whether the output opens a block) is left out."""
        lead = text.lstrip()
        if lead.startswith(_START):
            body = lead[len(_START):]
        elif partial and _START.startswith(lead):
            return "", ""  # whitespace or the start of "<think>": undecided
        elif implicit:
            body = text
        else:
            return "", text
        end = body.find(_END)
        if end >= 0:
            return body[:end], body[end + len(_END):]
        if partial:
            body = body[:len(body) - partial_tail(body, _END)]
        return body, ""

    def extract_reasoning(self, text: str, prompt_token_ids: Sequence[int] = ()) -> tuple[Optional[str], Optional[str]]:
        reasoning, content = self._split(text, self._implicit(prompt_token_ids), partial=False)
        return reasoning or None, content or None

    def extract_reasoning_streaming(self, previous_text: str, delta_text: str, prompt_token_ids: Sequence[int] = (),
                                    final: bool = False) -> tuple[str, str]:
        # Both splits are prefixes of the whole text's split, so the delta is their difference.
        implicit = self._implicit(prompt_token_ids)
        before = self._split(previous_text, implicit, partial=True)
        after = self._split(previous_text + delta_text, implicit, partial=not final)
        return after[0][len(before[0]):], after[1][len(before[1]):]


@register("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1: what comes before ``</think>`` is reasoning even without an opening ``<think>``."""

    implicit_start = True


@register("qwen3")
class Qwen3ReasoningParser(ThinkReasoningParser):
    """Qwen3: reasoning only inside a ``<think>`` block (opened by the output or by the prompt)."""

    implicit_start = False
