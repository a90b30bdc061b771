"""OpenAI response bodies from engine outputs: whole answers, stream chunks and usage.

Logprobs are clamped to -9999 (JSON has no -Infinity); ``usage`` reports the prompt tokens
served by the prefix cache as ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import time
from typing import Optional

from vpage.entrypoints.openai.prompt_logprobs import PromptEcho, prompt_logprobs_json
from vpage.entrypoints.openai.chat_output import ChatOutput
from vpage.outputs import CompletionOutput, RequestOutput

_MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def finish_reason(output: CompletionOutput) -> Optional[str]:
    """OpenAI's reason: "length", "stop" (EOS, stop string or token), or vLLM's "abort"."""
    reason = output.finish_reason
    return None if reason is None else (reason if reason in ("length", "abort") else "stop")


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _completion_logprobs(output: CompletionOutput, start: int, text_offset: int) -> Optional[dict]:
    """OpenAI's legacy logprobs of output tokens [start:]: tokens, their logprobs, top
    alternatives and text offsets."""
    if output.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(output.token_ids[start:], output.logprobs[start:]):
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token)
        token_logprobs.append(_logprob(chosen.logprob))
        top.append({lp.decoded_token: _logprob(lp.logprob) for lp in entry.values() if lp.rank is not None})
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(output: CompletionOutput, start: int) -> Optional[dict]:
    if output.logprobs is None:
        return None

    def item(lp) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": _logprob(lp.logprob), "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(output.token_ids[start:], output.logprobs[start:]):
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
        content.append({**item(entry[token_id]), "top_logprobs": [item(lp) for lp in ranked]})
    return {"content": content}


def _choice_usage(prompt_tokens: int, counts: dict[int, int], index: int, new_tokens: int) -> dict:
    """vLLM's per-chunk usage: the prompt's tokens and those choice ``index`` generated so far
    (``counts`` is updated with the chunk's ``new_tokens``)."""
    counts[index] = completion = counts.get(index, 0) + new_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


class ResponseBuilder:
    """Builds the response bodies of one API request (one or more engine requests): the whole
    answer from final outputs, or stream chunks from DELTA outputs as they come."""

    def __init__(self, request_id: str, model: str, chat: bool, n: int, echo: Optional[PromptEcho] = None,
                 usage_prompt_lens: Optional[list[int]] = None,
                 chat_output: Optional[ChatOutput] = None):
        self.id = request_id
        self.chat_output = chat_output  # reads reasoning and tool calls out of chat answers
        self.model = model
        self.chat = chat
        self.n = n
        self.echo = echo  # completions with echo: the prompts (and their logprobs)
        self.usage_prompt_lens = usage_prompt_lens  # continuous_usage_stats: each prompt's token count
        self._choice_tokens: dict[int, int] = {}  # choice index -> tokens streamed (continuous usage)
        self.created = int(time.time())
        self._text_offset: dict[int, int] = {}  # choice index -> characters already streamed
        self._finished: set[int] = set()  # choice indices whose finish reason was streamed
        self._completion_tokens = 0
        self._cached_tokens: dict[int, int] = {}  # prompt index -> prompt tokens served by the cache

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self, outputs: list[RequestOutput]) -> dict:
        """The whole answer: outputs[i] is the final output of prompt i."""
        if self.echo is not None:
            outputs = [self.echo.visible(o) for o in outputs]
        choices = []
        for p, out in enumerate(outputs):
            for c in out.outputs:
                index = p * self.n + c.index
                if self.chat:
                    message, reason = {"role": "assistant", "content": c.text}, finish_reason(c)
                    if self.chat_output is not None:
                        message, reason = self.chat_output.message(c.text, reason)
                    choices.append({"index": index, "message": message, "logprobs": _chat_logprobs(c, 0),
                                    "finish_reason": reason, "stop_reason": c.stop_reason})
                else:
                    prefix = self.echo.texts[p] if self.echo else ""
                    logprobs = _completion_logprobs(c, 0, len(prefix))
                    choices.append({"index": index, "text": prefix + c.text,
                                    "logprobs": self.echo.logprobs(p, out, logprobs) if self.echo else logprobs,
                                    "finish_reason": finish_reason(c), "stop_reason": c.stop_reason})
                    if out.prompt_logprobs is not None:
                        choices[-1]["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        body = {**self._head(False), "choices": choices, "usage": usage(outputs)}
        if self.chat and outputs and outputs[0].prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(outputs[0].prompt_logprobs)
        return body

    def chunks(self, prompt_index: int, delta: RequestOutput) -> list[dict]:
        """Stream chunks for a DELTA output of prompt ``prompt_index`` (what its step added)."""
        self._cached_tokens[prompt_index] = delta.num_cached_tokens
        if self.echo is not None:
            delta = self.echo.visible(delta)
        chunks = []
        for c in delta.outputs:
            index = prompt_index * self.n + c.index
            first = index not in self._text_offset
            prefix = self.echo.texts[prompt_index] if first and self.echo else ""  # echoed in the first chunk
            offset = self._text_offset.get(index, 0) + len(prefix)
            reason = finish_reason(c)
            if not (c.text or reason or first or c.token_ids):
                continue
            self._text_offset[index] = offset + len(c.text)
            self._completion_tokens += len(c.token_ids)
            if reason is not None:
                self._finished.add(index)
            if self.chat and self.chat_output is not None:
                fields, reason = self.chat_output.delta(index, c.text, reason)
                message = {"role": "assistant", **fields} if first else fields
                choice = {"index": index, "delta": message, "logprobs": _chat_logprobs(c, 0)}
            elif self.chat:
                message = {"role": "assistant", "content": c.text} if first else ({"content": c.text} if c.text else {})
                choice = {"index": index, "delta": message, "logprobs": _chat_logprobs(c, 0)}
            else:
                logprobs = _completion_logprobs(c, 0, offset)
                if first and self.echo:
                    logprobs = self.echo.logprobs(prompt_index, delta, logprobs)
                choice = {"index": index, "text": prefix + c.text, "logprobs": logprobs}
            chunk = {**self._head(True), "choices": [{**choice, "finish_reason": reason, "stop_reason": c.stop_reason}]}
            if self.usage_prompt_lens is not None:  # continuous_usage_stats: this choice's usage so far
                chunk["usage"] = _choice_usage(self.usage_prompt_lens[prompt_index], self._choice_tokens, index,
                                               len(c.token_ids))
            chunks.append(chunk)
        return chunks

    def abort_chunks(self, prompt_index: int) -> list[dict]:
        """Chunks ending, with ``finish_reason: "abort"``, the choices of prompt ``prompt_index``
        that have not finished (the request was aborted or timed out)."""
        ends = [CompletionOutput(i, "", [], None, None, "abort") for i in range(self.n)
                if prompt_index * self.n + i not in self._finished]
        if not ends:
            return []
        cached = self._cached_tokens.get(prompt_index, 0)
        return self.chunks(prompt_index, RequestOutput("", None, None, ends, True, num_cached_tokens=cached))

    def stream_usage_chunk(self, prompt_lens: list[int]) -> dict:
        """The usage chunk of a streamed answer whose prompts have ``prompt_lens`` tokens."""
        prompt = sum(prompt_lens)
        body = {"prompt_tokens": prompt, "completion_tokens": self._completion_tokens,
                "total_tokens": prompt + self._completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self._cached_tokens.values())}}
        return {**self._head(True), "choices": [], "usage": body}
