"""Qwen3 (dense): the Llama structure with an RMSNorm over each query and key head before
rotary (``q_norm``/``k_norm``, weights ``[head_dim]``), no QKV bias, ``head_dim`` from the
config (often not hidden / heads)."""

from __future__ import annotations

from typing import Any

import torch

from vpage import ops
from vpage.model_executor.forward_batch import ForwardBatch
from vpage.model_executor.layers.quantization import QuantConfig
from vpage.model_executor.layers.rms_norm import RMSNorm
from vpage.model_executor.layers.rotary import RotaryEmbedding
from vpage.model_executor.models.arch import LLAMA_GGUF_LAYER_NAMES, GgufArch, ModelArch
from vpage.model_executor.models.llama import DecoderParts, LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    """Llama's attention with the query and key heads RMS-normalised (each head over its
    ``head_size`` values, one weight vector shared by the heads) before they are rotated.
    Under tensor parallelism every rank holds the whole norm weights."""

    cpu_decoder_role = "attention_qk_norm"

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant: QuantConfig, prefix: str, layer_index: int):
        super().__init__(hf_config, dtype, quant, prefix, layer_index)
        # RMSNorm modules for their weights (and HF's names); the heads are normalised by
        # ops.rms_norm_heads_ in place on the QKV rows, not by RMSNorm.forward.
        self.q_norm = RMSNorm(self.head_size, hf_config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_size, hf_config.rms_norm_eps, dtype)

    def position_qk(self, q: torch.Tensor, k: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch) -> None:
        """q ``[num_tokens, num_heads * head_size]``, k ``[num_tokens, num_kv_heads *
        head_size]`` (row-strided views of the QKV output): normalise each head, then rotate."""
        ops.rms_norm_heads_(q, self.q_norm.weight, self.q_norm.eps, self.num_heads, self.head_size)
        ops.rms_norm_heads_(k, self.k_norm.weight, self.k_norm.eps, self.num_kv_heads, self.head_size)
        super().position_qk(q, k, rotary, batch)


class Qwen3ForCausalLM(LlamaForCausalLM):
    arch = ModelArch(
        architectures=("Qwen3ForCausalLM",),
        model_types={"qwen3": "Qwen3ForCausalLM"},
        gguf=GgufArch("qwen3", "Qwen3Config", layer_names={**LLAMA_GGUF_LAYER_NAMES,
                                                           "attn_q_norm": "self_attn.q_norm",
                                                           "attn_k_norm": "self_attn.k_norm"}),
    )
    parts = DecoderParts(attention=Qwen3Attention)
