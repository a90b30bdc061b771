"""Gemma 3 (text): Gemma 2's layer stack with a per-head RMSNorm (``1 + w``) on the queries
and keys before the rotary, one rope per layer type (global layers: base 1M, maybe linearly
scaled; sliding layers: base 10k), five sliding layers to each global one, and no attention
soft-cap. The multimodal ``Gemma3ForConditionalGeneration`` is not served (its GGUF text part,
arch "gemma3", is)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from vpage import ops
from vpage.model_executor.forward_batch import ForwardBatch
from vpage.model_executor.layers.quantization import QuantConfig
from vpage.model_executor.layers.rotary import RotaryEmbedding
from vpage.model_executor.models.arch import ModelArch
from vpage.model_executor.models.gemma2 import (GemmaAttention, GemmaMLP, GemmaRMSNorm, Gemma2ForCausalLM,
                                                gemma_norm)
from vpage.model_executor.models.gemma_gguf import GEMMA3_GGUF
from vpage.model_executor.models.llama import DecoderParts


class Gemma3Attention(GemmaAttention):
    """Gemma's attention with ``q_norm`` / ``k_norm`` over each query and key head."""

    cpu_decoder_role = "attention_qk_norm"

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant: QuantConfig, prefix: str, layer_index: int):
        super().__init__(hf_config, dtype, quant, prefix, layer_index)
        self.q_norm = GemmaRMSNorm(self.head_size, hf_config.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(self.head_size, hf_config.rms_norm_eps, dtype)

    @staticmethod
    def logits_soft_cap(hf_config: Any) -> Optional[float]:
        """None: transformers' Gemma 3 attention applies no soft-cap, whatever
        ``attn_logit_softcapping`` says (llama.cpp's converter refuses one)."""
        return None

    def position_qk(self, q: torch.Tensor, k: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch) -> None:
        """Normalise each query and key head in place, then rotate them."""
        ops.rms_norm_heads_(q, self.q_norm.weight, self.q_norm.eps, self.num_heads, self.head_size)
        ops.rms_norm_heads_(k, self.k_norm.weight, self.k_norm.eps, self.num_kv_heads, self.head_size)
        super().position_qk(q, k, rotary, batch)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    arch = ModelArch(
        architectures=("Gemma3ForCausalLM",),
        model_types={"gemma3_text": "Gemma3ForCausalLM"},
        gguf=GEMMA3_GGUF,
    )
    parts = DecoderParts(attention=Gemma3Attention, mlp=GemmaMLP, norm=gemma_norm)
