"""Mixtral: Llama's attention with a sparse MoE block in place of the MLP (``block_sparse_moe``:
a router over ``num_local_experts`` experts, the top ``num_experts_per_tok`` of each token's
softmax, renormalised)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vpage.model_executor.layers.quantization import QuantConfig
from vpage.model_executor.models.arch import LLAMA_GGUF_LAYER_NAMES, GgufArch, GgufMetadata
from vpage.model_executor.models.llama import DecoderParts, LlamaForCausalLM
from vpage.model_executor.models.moe import MoeModelArch, SparseMoeBlock, gguf_moe_config, gguf_moe_layer_names


def mixtral_moe(hf_config: Any, dtype: torch.dtype, quant: QuantConfig, prefix: str) -> nn.Module:
    return SparseMoeBlock(hf_config.hidden_size, hf_config.num_local_experts, hf_config.num_experts_per_tok,
                          hf_config.intermediate_size, True, dtype, quant, prefix)


def _has_experts(meta: GgufMetadata) -> bool:
    return int(meta.get("expert_count", 0) or 0) > 0


# llama.cpp writes Mixtral as "llama" with expert_count and merged expert tensors.
MIXTRAL_GGUF = GgufArch("llama", "MixtralConfig", permuted_qk=True,
                        config_fields=lambda meta: gguf_moe_config(meta, "num_local_experts"),
                        layer_names={**LLAMA_GGUF_LAYER_NAMES, **gguf_moe_layer_names("block_sparse_moe")},
                        matches=_has_experts)


class MixtralForCausalLM(LlamaForCausalLM):
    arch = MoeModelArch(
        architectures=("MixtralForCausalLM",),
        model_types={"mixtral": "MixtralForCausalLM"},
        gguf=MIXTRAL_GGUF,
        block_name="block_sparse_moe",
    )
    parts = DecoderParts(mlp=mixtral_moe)
