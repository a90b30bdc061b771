"""Mixtral: Llama's attention with a sparse MoE block in place of the MLP (``block_sparse_moe``:
a router over ``num_local_experts`` experts, the top ``num_experts_per_tok`` of each token's
softmax, renormalised)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vpage.model_executor.layers.quantization import QuantConfig
from vpage.model_executor.models.llama import DecoderParts, LlamaForCausalLM
from vpage.model_executor.models.moe import MoeModelArch, SparseMoeBlock


def mixtral_moe(hf_config: Any, dtype: torch.dtype, quant: QuantConfig, prefix: str) -> nn.Module:
    return SparseMoeBlock(hf_config.hidden_size, hf_config.num_local_experts, hf_config.num_experts_per_tok,
                          hf_config.intermediate_size, True, dtype, quant, prefix)


class MixtralForCausalLM(LlamaForCausalLM):
    arch = MoeModelArch(
        architectures=("MixtralForCausalLM",),
        model_types={"mixtral": "MixtralForCausalLM"},
        block_name="block_sparse_moe",
    )
    parts = DecoderParts(mlp=mixtral_moe)
    cpu_decoder_structure = None  # the C++ layer loop has no MoE block
