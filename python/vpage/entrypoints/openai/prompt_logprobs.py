"""Prompt logprobs over HTTP, shaped as vLLM answers them.

- vLLM's ``prompt_logprobs`` request field (completions and chat; not with ``stream``): the
  engine's ``RequestOutput.prompt_logprobs`` comes back as ``prompt_logprobs`` in each
  completion choice, and at the top of a chat response: per prompt token ``null`` for the
  first, then ``{token id: {"logprob", "rank", "decoded_token"}}``.
- /v1/completions ``echo`` with ``logprobs: N``: the choice's ``logprobs`` lists the prompt
  tokens first (the first with a null logprob and null top_logprobs, the others with their
  logprob and top_logprobs holding the token itself and the N most likely), then the
  generated ones; ``text_offset`` indexes the echoed text. ``max_tokens: 0`` with echo scores
  the prompt without generating: the engine generates one token, which is not reported.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from vpage.entrypoints.openai.protocol import MAX_TOP_LOGPROBS, ApiError
from vpage.outputs import Logprob, RequestOutput
from vpage.tokenizer import IncrementalDetokenizer

MAX_PROMPT_LOGPROBS = MAX_TOP_LOGPROBS
_MIN_LOGPROB = -9999.0  # JSON has no -Infinity (as responses.py)

PromptLogprobs = list[Optional[dict[int, Logprob]]]


def check_request(req: Any, chat: bool) -> None:
    """ApiError(400) for a bad ``prompt_logprobs`` or a ``max_tokens: 0`` without echo."""
    k = req.prompt_logprobs
    if k is not None:
        if not 0 <= k <= MAX_PROMPT_LOGPROBS:
            raise ApiError(400, f"prompt_logprobs must be between 0 and {MAX_PROMPT_LOGPROBS}, got {k}",
                           param="prompt_logprobs")
        if req.stream and k > 0:
            raise ApiError(400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    if req.max_tokens == 0 and (chat or not req.echo):
        raise ApiError(400, "max_tokens must be at least 1 (0 only with echo, which scores the prompt)",
                       param="max_tokens")


def scores_only(req: Any, chat: bool) -> bool:
    """Whether the request only scores its prompt (completions, ``echo`` and ``max_tokens: 0``)."""
    return not chat and req.echo and req.max_tokens == 0


def engine_prompt_logprobs(req: Any, chat: bool) -> Optional[int]:
    """``SamplingParams.prompt_logprobs`` for the request: its own field (unless streamed:
    streams do not carry it), else with echo the ``logprobs`` count (vLLM's rule)."""
    if req.prompt_logprobs is not None:
        return None if req.stream else req.prompt_logprobs
    if not chat and req.echo and req.logprobs is not None:
        return req.logprobs
    return None


def prompt_logprobs_json(entries: Optional[PromptLogprobs]) -> Optional[list]:
    """vLLM's JSON of ``RequestOutput.prompt_logprobs`` (token ids as keys, logprobs clamped)."""
    if entries is None:
        return None
    return [None if e is None else {str(tid): {"logprob": max(lp.logprob, _MIN_LOGPROB), "rank": lp.rank,
                                               "decoded_token": lp.decoded_token} for tid, lp in e.items()}
            for e in entries]


def echo_text_and_offsets(tokenizer: Any, ids: list[int]) -> tuple[str, list[int]]:
    """The text of ``ids`` and where each token's text starts in it: decoded token by token as
    generated text is (a character split over several tokens starts at the token completing it)."""
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    pieces, offsets, length = [], [], 0
    for tid in ids:
        offsets.append(length)
        piece = detok.add_token(tid)
        pieces.append(piece)
        length += len(piece)
    text = "".join(pieces)
    whole = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if whole.startswith(text):  # a character the last tokens left incomplete
        text = whole
    return text, offsets


class PromptEcho:
    """The echoed prompts of one /v1/completions request and, with ``logprobs``, their
    tokens' logprobs (``top``: how many alternatives each lists)."""

    def __init__(self, tokenizer: Any, prompts: list[list[int]], top: Optional[int], score_only: bool):
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.top = top
        self.score_only = score_only
        if top is None:
            self.texts, self.offsets = [tokenizer.decode(ids) for ids in prompts], None
        else:
            pairs = [echo_text_and_offsets(tokenizer, ids) for ids in prompts]
            self.texts, self.offsets = [t for t, _ in pairs], [o for _, o in pairs]
        self._prompt_logprobs: dict[int, PromptLogprobs] = {}  # prompt index -> its logprobs, once they came

    def visible(self, out: RequestOutput) -> RequestOutput:
        """``out`` as the client sees it: without the token generated to score a prompt."""
        if not self.score_only:
            return out
        hidden = [dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                                      cumulative_logprob=None) for c in out.outputs]
        return dataclasses.replace(out, outputs=hidden)

    def logprobs(self, prompt_index: int, out: RequestOutput, generated: Optional[dict]) -> Optional[dict]:
        """OpenAI's legacy ``logprobs`` of an echoed choice: the prompt's tokens, then
        ``generated`` (the generated tokens', offsets already past the echoed text)."""
        if out.prompt_logprobs is not None:
            self._prompt_logprobs[prompt_index] = out.prompt_logprobs
        entries = self._prompt_logprobs.get(prompt_index)
        if self.top is None or entries is None:
            return generated
        ids, offsets = self.prompts[prompt_index], self.offsets[prompt_index]
        tokens, token_logprobs, top = [], [], []
        for tid, entry in zip(ids, entries):
            if entry is None:
                tokens.append(self.tokenizer.decode([tid]))
                token_logprobs.append(None)
                top.append(None)
                continue
            tokens.append(entry[tid].decoded_token)
            token_logprobs.append(max(entry[tid].logprob, _MIN_LOGPROB))
            # The token itself first, then the `top` most likely: at most top + 1 (OpenAI's rule).
            top.append({lp.decoded_token: max(lp.logprob, _MIN_LOGPROB)
                        for lp in list(entry.values())[:self.top + 1]})
        result = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                  "text_offset": list(offsets)}
        for key in result if generated else ():
            result[key] += generated[key]
        return result
