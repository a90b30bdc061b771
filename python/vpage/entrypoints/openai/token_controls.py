"""The request fields that steer single tokens: ``logit_bias`` (OpenAI's), ``allowed_token_ids``
and ``bad_words`` (vLLM's), turned into SamplingParams arguments and checked against the
model's vocabulary before a request reaches the engine (a 400 naming the ids, never an
engine error)."""

from __future__ import annotations

from typing import Any, Optional

from vpage.entrypoints.openai.protocol import ApiError
from vpage.sampling_params import SamplingParams, out_of_vocab

_MAX_BIAS = 100.0  # OpenAI's range for logit_bias values


def token_control_kwargs(req: Any, vocab_size: int) -> dict:
    """SamplingParams arguments of the request's token controls: logit_bias keys (JSON object
    keys, so strings) become token ids and values are clamped to [-100, 100]; ApiError(400)
    for a key that is not a token id, or ids outside ``[0, vocab_size)``."""
    kwargs: dict[str, Any] = {}
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise ApiError(400, f"logit_bias keys must be token ids, got {key[:40]!r}",
                               param="logit_bias") from None
            bias[token] = min(_MAX_BIAS, max(-_MAX_BIAS, value))
        kwargs["logit_bias"] = bias
    if req.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(req.allowed_token_ids)
    for name in ("logit_bias", "allowed_token_ids"):
        bad = [t for t in kwargs.get(name, ()) if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"token id(s) {bad[:10]} in {name} are out of the vocabulary (size {vocab_size})",
                           param=name)
    if req.bad_words:
        kwargs["bad_words"] = list(req.bad_words)
    return kwargs


def check_bad_words(params: SamplingParams, tokenizer: Optional[Any], vocab_size: int) -> None:
    """Tokenizes ``params.bad_words`` as the engine will; ApiError(400) when the model has no
    tokenizer or a word's tokens fall outside the vocabulary."""
    if not params.bad_words:
        return
    if tokenizer is None:
        raise ApiError(400, "bad_words need a tokenizer; this model has none", param="bad_words")
    params.update_from_tokenizer(tokenizer)
    bad = out_of_vocab(params, vocab_size)
    if bad is not None:
        raise ApiError(400, f"token id(s) {bad[1]} of bad_words are out of the vocabulary (size {vocab_size})",
                       param="bad_words")
