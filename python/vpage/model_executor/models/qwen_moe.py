"""Qwen2-MoE and Qwen3-MoE: Qwen2's and Qwen3's attention with sparse MoE blocks (softmax over
``num_experts``, the top ``num_experts_per_tok``, renormalised when ``norm_topk_prob``; experts
of ``moe_intermediate_size``) in the layers ``decoder_sparse_step`` and ``mlp_only_layers``
select, dense MLPs elsewhere. Qwen2-MoE adds a shared expert to every block, scaled by a
sigmoid gate."""

from __future__ import annotations

import functools
from typing import Any

from vpage.model_executor.models.arch import LLAMA_GGUF_LAYER_NAMES, GgufArch, GgufMetadata
from vpage.model_executor.models.llama import DecoderParts, LlamaAttention, LlamaForCausalLM, LlamaMLP
from vpage.model_executor.models.moe import (MoeModelArch, gguf_moe_config, gguf_moe_layer_names,
                                             gguf_shared_gate_as_row, qwen_moe_mlp)
from vpage.model_executor.models.qwen3 import Qwen3Attention


def _qwen2_moe_attention(hf_config: Any, *args: Any, **kwargs: Any) -> LlamaAttention:
    return LlamaAttention(hf_config, *args, qkv_bias=bool(getattr(hf_config, "qkv_bias", True)), **kwargs)


def _qwen2_moe_gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    """Qwen2-MoE's experts and shared expert sizes; llama.cpp does not renormalise its top-k."""
    fields = gguf_moe_config(meta, "num_experts")
    fields.update(moe_intermediate_size=int(meta.get("expert_feed_forward_length")),
                  shared_expert_intermediate_size=int(meta.get("expert_shared_feed_forward_length")),
                  norm_topk_prob=False, qkv_bias=meta.has_tensor("blk.0.attn_q.bias"))
    return fields


def _qwen3_moe_gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    """Qwen3-MoE's experts; its top-k is renormalised (llama.cpp's expert_weights_norm, true
    when absent, as llama.cpp builds qwen3moe)."""
    fields = gguf_moe_config(meta, "num_experts")
    fields.update(moe_intermediate_size=int(meta.get("expert_feed_forward_length")),
                  norm_topk_prob=bool(meta.get("expert_weights_norm", True)))
    return fields


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    arch = MoeModelArch(
        architectures=("Qwen2MoeForCausalLM",),
        model_types={"qwen2_moe": "Qwen2MoeForCausalLM"},
        gguf=GgufArch("qwen2moe", "Qwen2MoeConfig", config_fields=_qwen2_moe_gguf_config,
                      layer_names={**LLAMA_GGUF_LAYER_NAMES, **gguf_moe_layer_names("mlp")},
                      tensor_transform=gguf_shared_gate_as_row),
    )
    parts = DecoderParts(attention=_qwen2_moe_attention,
                         mlp=functools.partial(qwen_moe_mlp, shared=True, dense_mlp=LlamaMLP))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    arch = MoeModelArch(
        architectures=("Qwen3MoeForCausalLM",),
        model_types={"qwen3_moe": "Qwen3MoeForCausalLM"},
        gguf=GgufArch("qwen3moe", "Qwen3MoeConfig", config_fields=_qwen3_moe_gguf_config,
                      layer_names={**LLAMA_GGUF_LAYER_NAMES, **gguf_moe_layer_names("mlp"),
                                   "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}),
    )
    parts = DecoderParts(attention=Qwen3Attention,
                         mlp=functools.partial(qwen_moe_mlp, shared=False, dense_mlp=LlamaMLP))
