"""OpenAI API bodies: requests to (prompt token ids, SamplingParams), outputs to responses.

Field names follow OpenAI's completions and chat completions APIs, plus vLLM's extra
sampling fields (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids,
skip_special_tokens, include_stop_str_in_output, use_beam_search, length_penalty).
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

from vpage.outputs import CompletionOutput, RequestOutput
from vpage.sampling_params import SamplingParams

# Request fields that map one to one onto SamplingParams.
_SAMPLING_FIELDS = (
    "n", "best_of", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
    "skip_special_tokens", "include_stop_str_in_output", "use_beam_search", "length_penalty",
)
_UNSUPPORTED = ("suffix", "logit_bias", "tools", "functions", "response_format")
MAX_TOP_LOGPROBS = 20


class ApiError(Exception):
    """An error answered with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"null")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _reject_unsupported(body: dict) -> None:
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, {}, [], ""):
            raise ApiError(400, f"'{name}' is not supported by vpage", param=name)


def sampling_params(body: dict, prompt_len: int, max_model_len: int, *, chat: bool) -> SamplingParams:
    """SamplingParams of a request; ApiError(400) for bad or unsupported values. Completions
    default to 16 new tokens (OpenAI's default), chat to the room left in the context."""
    _reject_unsupported(body)
    kwargs = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    max_tokens = body.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens", None if chat else 16)
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ApiError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens")
        if prompt_len + max_tokens > max_model_len:
            raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens; the request "
                                f"has {prompt_len} prompt tokens and asks for {max_tokens} more", param="max_tokens")
    kwargs["max_tokens"] = max_tokens
    if chat:
        if body.get("logprobs"):
            top = body.get("top_logprobs") or 0
            if not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
                raise ApiError(400, f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
            kwargs["logprobs"] = top
    elif body.get("logprobs") is not None:
        if not isinstance(body["logprobs"], int) or not 0 <= body["logprobs"] <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
        kwargs["logprobs"] = body["logprobs"]
    try:
        params = SamplingParams(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, str(exc)) from None
    if body.get("stream") and (params.best_of != params.n or params.use_beam_search):
        # Streamed text must only grow: hidden samples and beams that swap places cannot be streamed.
        raise ApiError(400, "streaming needs best_of equal to n and no beam search", param="best_of")
    return params


def completion_prompts(body: dict, tokenizer: Any) -> list[list[int]]:
    """The token ids of each prompt: a string, a list of strings, a list of token ids, or a
    list of token id lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                            "token id lists", param="prompt")
    ids = []
    for p in prompts:
        if isinstance(p, str):
            ids.append(list(tokenizer.encode(p)))
        elif all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            ids.append(list(p))
        else:
            raise ApiError(400, "a token id prompt must hold integers only", param="prompt")
    return ids


def _message_text(message: Any, index: int) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, f"messages[{index}] must be an object with a string 'role'", param="messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ApiError(400, f"messages[{index}]: only text content parts are supported", param="messages")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{index}].content must be a string or text parts", param="messages")
    return {"role": message["role"], "content": content}


def chat_prompt(body: dict, tokenizer: Any) -> list[int]:
    """The conversation through the model's chat template, ready for the assistant's turn."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    conversation = [_message_text(m, i) for i, m in enumerate(messages)]
    try:
        return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise ApiError(400, f"the chat template failed on these messages: {exc}", param="messages") from None


def finish_reason(output: CompletionOutput) -> Optional[str]:
    return None if output.finish_reason is None else ("length" if output.finish_reason == "length" else "stop")


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_logprobs(output: CompletionOutput, start: int, text_offset: int) -> Optional[dict]:
    """OpenAI's legacy logprobs of output tokens [start:]: tokens, their logprobs, top
    alternatives and text offsets."""
    if output.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(output.token_ids[start:], output.logprobs[start:]):
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token)
        token_logprobs.append(chosen.logprob)
        top.append({lp.decoded_token: lp.logprob for lp in entry.values() if lp.rank is not None})
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(output: CompletionOutput, start: int) -> Optional[dict]:
    if output.logprobs is None:
        return None

    def item(lp) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(output.token_ids[start:], output.logprobs[start:]):
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
        content.append({**item(entry[token_id]), "top_logprobs": [item(lp) for lp in ranked]})
    return {"content": content}


class ResponseBuilder:
    """Builds the response bodies of one API request (one or more engine requests)."""

    def __init__(self, request_id: str, model: str, chat: bool, n: int, echo_prompts: Optional[list[str]] = None):
        self.id = request_id
        self.model = model
        self.chat = chat
        self.n = n
        self.echo_prompts = echo_prompts  # completions with echo: the prompt texts
        self.created = int(time.time())
        self._sent_text: dict[int, int] = {}  # choice index -> characters already streamed
        self._sent_tokens: dict[int, int] = {}

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self, outputs: list[RequestOutput]) -> dict:
        """The whole answer: outputs[i] is the final output of prompt i."""
        choices = []
        for p, out in enumerate(outputs):
            for c in out.outputs:
                index = p * self.n + c.index
                if self.chat:
                    choices.append({"index": index, "message": {"role": "assistant", "content": c.text},
                                    "logprobs": _chat_logprobs(c, 0), "finish_reason": finish_reason(c)})
                else:
                    prefix = self.echo_prompts[p] if self.echo_prompts else ""
                    choices.append({"index": index, "text": prefix + c.text,
                                    "logprobs": _completion_logprobs(c, 0, len(prefix)),
                                    "finish_reason": finish_reason(c)})
        return {**self._head(False), "choices": choices, "usage": usage(outputs)}

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        """Stream chunks for what ``out`` (cumulative) adds since the last call."""
        chunks = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            first = index not in self._sent_text
            text_start, token_start = self._sent_text.get(index, 0), self._sent_tokens.get(index, 0)
            delta, reason = c.text[text_start:], finish_reason(c)
            if not (delta or reason or first or len(c.token_ids) > token_start):
                continue
            self._sent_text[index], self._sent_tokens[index] = len(c.text), len(c.token_ids)
            if self.chat:
                message = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta else {})
                choice = {"index": index, "delta": message, "logprobs": _chat_logprobs(c, token_start)}
            else:
                if first and self.echo_prompts:
                    delta = self.echo_prompts[prompt_index] + delta
                choice = {"index": index, "text": delta,
                          "logprobs": _completion_logprobs(c, token_start, text_start)}
            chunks.append({**self._head(True), "choices": [{**choice, "finish_reason": reason}]})
        return chunks

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        return {**self._head(True), "choices": [], "usage": usage(outputs)}
