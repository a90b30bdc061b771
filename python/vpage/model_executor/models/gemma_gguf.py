"""How llama.cpp's converter writes Gemma 2 ("gemma2") and Gemma 3 text ("gemma3") GGUF files,
and how its loader reads what a file leaves out.

Tensors: Llama's names, with the pre-feedforward norm as "ffn_norm", the post-norms as
"post_attention_norm" / "post_ffw_norm", Gemma 3's per-head norms as "attn_q_norm" /
"attn_k_norm"; no Q/K permutation; every norm weight stored as ``w + 1``. Metadata: the
layer pattern is not stored (llama.cpp fixes it: one global layer in each 2 for Gemma 2, in
each 6 for Gemma 3), nor the attention scale (the head size, or hidden / heads for the 27B
models), nor Gemma 3's local rope base in older files (10000).
"""

from __future__ import annotations

from typing import Any, Optional

from vpage.model_executor.layers.weight_utils import float_tensor
from vpage.model_executor.models.arch import LLAMA_GGUF_LAYER_NAMES, GgufArch, GgufMetadata, llama_gguf_config

GEMMA2_GGUF_LAYER_NAMES = {
    **LLAMA_GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA3_GGUF_LAYER_NAMES = {
    **GEMMA2_GGUF_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def norms_minus_one(name: str, tensor: Any) -> Any:
    """A Gemma GGUF tensor as transformers holds it: the norm weights, stored + 1, come back
    as w (the model's norm loader adds the 1 again; exact in float32 for stored values >= 0.5)."""
    return float_tensor(tensor) - 1 if name.endswith("norm.weight") else tensor


def layer_types(num_layers: int, period: int) -> list[str]:
    """llama.cpp's Gemma pattern: in each run of ``period`` layers, all but the last attend
    through the sliding window (transformers' default ``layer_types`` too)."""
    return ["sliding_attention" if i % period < period - 1 else "full_attention" for i in range(num_layers)]


def query_pre_attn_scalar(fields: dict[str, Any], layers_of_27b: int) -> int:
    """llama.cpp's attention scale: the 27B model (known by its layer count) scales by
    hidden_size / heads, the others by the head size."""
    if fields["num_hidden_layers"] == layers_of_27b:
        return fields["hidden_size"] // fields["num_attention_heads"]
    return fields["head_dim"]


def _soft_cap(value: Any) -> Optional[float]:
    return float(value) if value else None


def gemma2_gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    """Gemma2Config fields, with llama.cpp's defaults for the keys a file may omit (window
    4096, soft-caps 50 and 30)."""
    fields = llama_gguf_config(meta)
    fields.update(
        sliding_window=int(meta.get("attention.sliding_window", 4096)),
        layer_types=layer_types(fields["num_hidden_layers"], 2),
        attn_logit_softcapping=_soft_cap(meta.get("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=_soft_cap(meta.get("final_logit_softcapping", 30.0)),
        query_pre_attn_scalar=query_pre_attn_scalar(fields, 46),
    )
    return fields


def gemma3_gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    """Gemma3TextConfig fields: rope.freq_base and the rope scaling are the global layers',
    rope.freq_base_swa (default 10000, unscaled) the sliding layers'; no sliding_window key
    means every layer is global."""
    fields = llama_gguf_config(meta)
    theta, scaling = fields.pop("rope_theta"), fields.pop("rope_scaling")
    window = int(meta.get("attention.sliding_window", 0))
    num_layers = fields["num_hidden_layers"]
    fields.update(
        rope_parameters={
            "full_attention": {**(scaling or {"rope_type": "default"}), "rope_theta": theta},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": float(meta.get("rope.freq_base_swa", 10000.0))},
        },
        sliding_window=window or None,
        layer_types=layer_types(num_layers, 6) if window else ["full_attention"] * num_layers,
        final_logit_softcapping=_soft_cap(meta.get("final_logit_softcapping", None)),
        query_pre_attn_scalar=query_pre_attn_scalar(fields, 62),
    )
    return fields


GEMMA2_GGUF = GgufArch("gemma2", "Gemma2Config", config_fields=gemma2_gguf_config,
                       layer_names=GEMMA2_GGUF_LAYER_NAMES, tensor_transform=norms_minus_one)
GEMMA3_GGUF = GgufArch("gemma3", "Gemma3TextConfig", config_fields=gemma3_gguf_config,
                       layer_names=GEMMA3_GGUF_LAYER_NAMES, tensor_transform=norms_minus_one)
