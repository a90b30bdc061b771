"""Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention with sparse MoE blocks (softmax over
``num_experts``, the top ``num_experts_per_tok``, renormalised when ``norm_topk_prob``; experts
of ``moe_intermediate_size``) in the layers ``decoder_sparse_step`` and ``mlp_only_layers``
select, dense MLPs elsewhere. Qwen2-MoE adds a shared expert to every block, scaled by a
sigmoid gate."""

from __future__ import annotations

import functools
from typing import Any

from vpage.model_executor.models.llama import DecoderParts, LlamaAttention, LlamaForCausalLM, LlamaMLP
from vpage.model_executor.models.moe import MoeModelArch, qwen_moe_mlp
from vpage.model_executor.models.qwen3 import Qwen3Attention


def _qwen2_moe_attention(hf_config: Any, *args: Any, **kwargs: Any) -> LlamaAttention:
    return LlamaAttention(hf_config, *args, qkv_bias=bool(getattr(hf_config, "qkv_bias", True)), **kwargs)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    arch = MoeModelArch(
        architectures=("Qwen2MoeForCausalLM",),
        model_types={"qwen2_moe": "Qwen2MoeForCausalLM"},
    )
    parts = DecoderParts(attention=_qwen2_moe_attention,
                         mlp=functools.partial(qwen_moe_mlp, shared=True, dense_mlp=LlamaMLP))
    cpu_decoder_structure = None  # the C++ layer loop has no MoE block


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    arch = MoeModelArch(
        architectures=("Qwen3MoeForCausalLM",),
        model_types={"qwen3_moe": "Qwen3MoeForCausalLM"},
    )
    parts = DecoderParts(attention=Qwen3Attention,
                         mlp=functools.partial(qwen_moe_mlp, shared=False, dense_mlp=LlamaMLP))
    cpu_decoder_structure = None  # the C++ layer loop has no MoE block
