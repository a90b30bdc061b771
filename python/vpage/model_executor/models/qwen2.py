"""Qwen2: the Llama structure with biases on the Q, K and V projections."""

from __future__ import annotations

import functools

from vpage.model_executor.models.arch import GgufArch, ModelArch
from vpage.model_executor.models.llama import DecoderParts, LlamaAttention, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    arch = ModelArch(
        architectures=("Qwen2ForCausalLM",),
        model_types={"qwen2": "Qwen2ForCausalLM"},
        gguf=GgufArch("qwen2", "Qwen2Config"),
    )
    parts = DecoderParts(attention=functools.partial(LlamaAttention, qkv_bias=True))
