"""Phi-3 family (Phi-3, Phi-3.5-mini, Phi-4-mini): the Llama structure with q/k/v and gate/up
stored fused in the checkpoint (loaded as they are), longrope (short/long factors), partial
rotary (Phi-4-mini rotates 3/4 of each head) and a sliding window on every layer: Llama's
parts do all of it (the rotary reads the rope kind and partial factor, the attention the
window)."""

from __future__ import annotations

from typing import Any

from vpage.model_executor.models.arch import (LLAMA_GGUF_LAYER_NAMES, GgufArch, GgufMetadata, ModelArch,
                                              llama_gguf_config)
from vpage.model_executor.models.llama import LlamaForCausalLM

# llama.cpp's phi3 tensors: one attn_qkv, and ffn_up holding gate then up (no ffn_gate).
PHI3_GGUF_LAYER_NAMES = {
    **{gguf: hf for gguf, hf in LLAMA_GGUF_LAYER_NAMES.items() if gguf not in ("attn_q", "attn_k", "attn_v",
                                                                            "ffn_gate", "ffn_up")},
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}


def phi3_gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    """Phi3Config fields from llama.cpp's phi3 metadata: the Llama keys, the rotary
    dimensions (``rope.dimension_count``), the original context of longrope and the sliding
    window (0: none)."""
    fields = llama_gguf_config(meta)
    head_dim = fields["head_dim"]
    window = int(meta.get("attention.sliding_window", 0))
    fields.update(
        partial_rotary_factor=int(meta.get("rope.dimension_count", head_dim)) / head_dim,
        original_max_position_embeddings=int(meta.get("rope.scaling.original_context_length",
                                                      fields["max_position_embeddings"])),
        sliding_window=window or None,
        pad_token_id=None,
    )
    return fields


class Phi3ForCausalLM(LlamaForCausalLM):
    arch = ModelArch(
        architectures=("Phi3ForCausalLM",),
        model_types={"phi3": "Phi3ForCausalLM"},
        gguf=GgufArch("phi3", "Phi3Config", config_fields=phi3_gguf_config, layer_names=PHI3_GGUF_LAYER_NAMES),
    )
    # Llama's parts for the C++ layer loop, which takes a static rope table (partial rotary
    # too) and each layer's window; longrope has no static table: such a model runs the Python layers.
    cpu_decoder_structure = "llama"
