"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` with the served model's tokenizer.

``/tokenize`` takes a ``prompt`` (special tokens such as BOS added unless
``add_special_tokens`` is false) or chat ``messages`` rendered by the chat template
(``add_generation_prompt``, default true; ``continue_final_message``; special tokens only
what the template writes unless ``add_special_tokens``), and answers ``count``,
``max_model_len``, ``tokens`` and, with ``return_token_strs``, ``token_strs``.
``/detokenize`` turns ``tokens`` back into the ``prompt`` text.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import Field

from vpage.entrypoints.openai.protocol import ApiError, ChatMessage, TokenId, _Strict, parse_body


class TokenizeRequest(_Strict):
    """vLLM's TokenizeCompletionRequest (``prompt``) and TokenizeChatRequest (``messages``) in one."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: Optional[bool] = None  # default: true for a prompt, false for messages
    return_token_strs: Optional[bool] = False


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[TokenId]


class Tokenization:
    """The two routes' answers for ``serving`` (an OpenAIServing: model name, engine info)."""

    def __init__(self, serving: Any):
        self.serving = serving

    def _tokenizer(self, model: Optional[str]) -> Any:
        if model is not None and model != self.serving.model_name:
            raise ApiError(404, f"the model `{model}` does not exist; this server serves `{self.serving.model_name}`",
                           kind="not_found_error", param="model")
        tokenizer = self.serving.client.tokenizer
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        return tokenizer

    def tokenize(self, raw: bytes) -> dict:
        req = parse_body(raw, TokenizeRequest)
        tokenizer = self._tokenizer(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "send exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            if req.add_generation_prompt and req.continue_final_message:
                raise ApiError(400, "add_generation_prompt and continue_final_message cannot both be true",
                               param="continue_final_message")
            conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                text = tokenizer.apply_chat_template(conversation, add_generation_prompt=req.add_generation_prompt,
                                                     continue_final_message=req.continue_final_message,
                                                     tokenize=False)
            except Exception:  # noqa: BLE001 - a template error is the request's fault
                raise ApiError(400, "the chat template failed on these messages", param="messages") from None
            ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tokenizer.encode(req.prompt, add_special_tokens=special)
        ids = list(ids)
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.serving.client.info.max_model_len, "tokens": ids,
                "token_strs": strs}

    def detokenize(self, raw: bytes) -> dict:
        req = parse_body(raw, DetokenizeRequest)
        tokenizer = self._tokenizer(req.model)
        vocab = self.serving.client.info.vocab_size
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise ApiError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}
