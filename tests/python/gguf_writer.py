"""A GGUF writer for the tests, following llama.cpp's converter (convert_hf_to_gguf.py): its
tensor names, its Q/K row permutation and its metadata keys, one table entry per family.

It is written from llama.cpp's conventions, not from vpage's reader (models/arch.py), so a
GGUF test checks the reader against an independent description of the format. A family adds a
``GgufFamily`` to ``FAMILIES`` under its Hugging Face ``model_type``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np

# Hugging Face module (after "model.layers.N.") -> GGUF tensor (after "blk.N."), Llama-shaped.
LLAMA_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
LLAMA_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# Mixtures of experts: the router and the converter's merged expert stacks (it stacks each
# expert's gate, up and down matrices into ``...experts.{part}`` [experts, rows, cols]), and
# Qwen2-MoE's shared expert and its gate.
MOE_LAYER_NAMES = {
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter layout of a Q/K projection: per head, rows (2, pairs) -> (pairs, 2)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_theta_of(cfg: Any) -> float:
    """The rope base of a transformers 5 config (``rope_parameters``), or of a 4.x one."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def write_common_metadata(writer: Any, cfg: Any) -> None:
    """The keys every Llama-shaped family writes (``{arch}.block_count`` and so on)."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim and head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope_theta_of(cfg))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)


@dataclass(frozen=True)
class GgufFamily:
    """How llama.cpp's converter writes one family."""

    arch: str  # general.architecture
    layer_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_LAYER_NAMES)
    global_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GLOBAL_NAMES)
    permute_qk: bool = False  # the converter interleaves each head's Q/K rows (llama)
    # writer, hf config -> None: every metadata key of the family but the tokenizer's
    metadata: Callable[[Any, Any], None] = write_common_metadata
    # (hf name, float32 array, hf config) -> array as the converter stores it (e.g. norms + 1)
    transform: Optional[Callable[[str, np.ndarray, Any], np.ndarray]] = None
    # (writer, hf model) -> None: tensors the converter adds beyond the checkpoint's (rope_freqs)
    extra_tensors: Optional[Callable[[Any, Any], None]] = None


def write_qwen3_metadata(writer: Any, cfg: Any) -> None:
    """Qwen3's keys: the converter writes the key/value lengths whenever the config has a
    ``head_dim``, which Qwen3's always has."""
    write_common_metadata(writer, cfg)
    if cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)


# Gemma (the converter's Gemma2Model / Gemma3Model): the pre-feedforward norm is "ffn_norm",
# every norm weight is stored + 1, no Q/K permutation, no output tensor when tied.
GEMMA_LAYER_NAMES = {
    **LLAMA_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gemma_norms_plus_one(name: str, w: np.ndarray, cfg: Any) -> np.ndarray:
    return w + 1 if name.endswith("norm.weight") else w


def _write_gemma_shape(writer: Any, cfg: Any) -> None:
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)


def write_gemma2_metadata(writer: Any, cfg: Any) -> None:
    """Gemma 2's keys: no rope base (llama.cpp's default 10000 is Gemma 2's), no layer pattern
    and no attention scale (llama.cpp derives both)."""
    _write_gemma_shape(writer, cfg)
    writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)


def write_gemma3_metadata(writer: Any, cfg: Any) -> None:
    """Gemma 3's keys: the global layers' rope base and linear scaling, the sliding layers'
    base (rope.freq_base_swa), the final soft-cap when set, the window; no vocab size (the
    converter takes it from the tokenizer)."""
    _write_gemma_shape(writer, cfg)
    full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
    if full.get("rope_type") == "linear":
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_rope_freq_base_swa(local["rope_theta"])
    if cfg.final_logit_softcapping:
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)


def write_llama_metadata(writer: Any, cfg: Any) -> None:
    """Llama's keys: the common ones and the converter's rope scaling keys (linear: type and
    factor; yarn: also the original context and the betas or attention factor the config
    sets; llama3 goes into the rope_freqs tensor instead)."""
    import gguf

    write_common_metadata(writer, cfg)
    params = cfg.rope_parameters
    kind = params.get("rope_type")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(params["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        if params.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(params["attention_factor"])
        if params.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(params["beta_fast"])
        if params.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(params["beta_slow"])


def write_llama3_rope_freqs(writer: Any, hf_model: Any) -> None:
    """The converter's rope_freqs for a llama3 rope (LlamaModel.generate_extra_tensors): per
    frequency the divisor of llama3's smoothing (1 for short wavelengths, factor for long).

    The converter reads original_max_position_embeddings at the config's top level (8192,
    Llama 3.1's, when absent); a transformers 5 config keeps it in rope_parameters, read here."""
    import torch

    cfg = hf_model.config
    params = cfg.rope_parameters
    if params.get("rope_type") != "llama3":
        return
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))


# Phi-3 (the converter's Phi3MiniModel): q/k/v and gate/up stay fused, in attn_qkv and ffn_up.
PHI3_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _phi3_rope_dims(cfg: Any) -> int:
    return int(cfg.rope_parameters.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads


def write_phi3_metadata(writer: Any, cfg: Any) -> None:
    """Phi-3's keys: the original context, the rotary dimensions, the window (0 for none); no
    vocab size and no scaling type."""
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(_phi3_rope_dims(cfg))
    writer.add_rope_freq_base(rope_theta_of(cfg))
    writer.add_sliding_window(cfg.sliding_window or 0)


def write_phi3_rope_factors(writer: Any, hf_model: Any) -> None:
    """A longrope config's long and short factors, and the attention factor the converter
    derives from max / original context (the config's own attention_factor is not read)."""
    cfg = hf_model.config
    params = cfg.rope_parameters
    if params.get("rope_type", "default") == "default":
        return
    original = cfg.original_max_position_embeddings
    scale = cfg.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    if not len(params["long_factor"]) == len(params["short_factor"]) == _phi3_rope_dims(cfg) // 2:
        raise ValueError("rope long and short factors must have rotary dimensions / 2 entries")
    writer.add_tensor("rope_factors_long.weight", np.array(params["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(params["short_factor"], dtype=np.float32))


def _write_experts(writer: Any, cfg: Any, experts: int) -> None:
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)


def write_mixtral_metadata(writer: Any, cfg: Any) -> None:
    """Mixtral is written as "llama" with its expert counts (feed_forward_length: an expert's)."""
    write_llama_metadata(writer, cfg)
    _write_experts(writer, cfg, cfg.num_local_experts)


def write_qwen2_moe_metadata(writer: Any, cfg: Any) -> None:
    write_common_metadata(writer, cfg)
    _write_experts(writer, cfg, cfg.num_experts)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def write_qwen3_moe_metadata(writer: Any, cfg: Any) -> None:
    write_qwen3_metadata(writer, cfg)
    _write_experts(writer, cfg, cfg.num_experts)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def shared_gate_as_vector(name: str, w: np.ndarray, cfg: Any) -> np.ndarray:
    """ffn_gate_inp_shexp is one vector of hidden values in llama.cpp's layout."""
    return w.reshape(-1) if name.endswith("shared_expert_gate.weight") else w


FAMILIES: dict[str, GgufFamily] = {
    "llama": GgufFamily("llama", permute_qk=True, metadata=write_llama_metadata,
                        extra_tensors=write_llama3_rope_freqs),
    "qwen2": GgufFamily("qwen2"),
    "qwen3": GgufFamily("qwen3", layer_names={**LLAMA_LAYER_NAMES, "self_attn.q_norm": "attn_q_norm",
                                              "self_attn.k_norm": "attn_k_norm"},
                        metadata=write_qwen3_metadata),
    "phi3": GgufFamily("phi3", layer_names=PHI3_LAYER_NAMES, metadata=write_phi3_metadata,
                       extra_tensors=write_phi3_rope_factors),
    "gemma2": GgufFamily("gemma2", layer_names=GEMMA_LAYER_NAMES, metadata=write_gemma2_metadata,
                         transform=gemma_norms_plus_one),
    "gemma3_text": GgufFamily("gemma3", layer_names={**GEMMA_LAYER_NAMES, "self_attn.q_norm": "attn_q_norm",
                                                     "self_attn.k_norm": "attn_k_norm"},
                              metadata=write_gemma3_metadata, transform=gemma_norms_plus_one),
    "mixtral": GgufFamily("llama", layer_names={**LLAMA_LAYER_NAMES, **MOE_LAYER_NAMES}, permute_qk=True,
                          metadata=write_mixtral_metadata),
    "qwen2_moe": GgufFamily("qwen2moe", layer_names={**LLAMA_LAYER_NAMES, **MOE_LAYER_NAMES},
                            metadata=write_qwen2_moe_metadata, transform=shared_gate_as_vector),
    "qwen3_moe": GgufFamily("qwen3moe", layer_names={**LLAMA_LAYER_NAMES, **MOE_LAYER_NAMES,
                                                     "self_attn.q_norm": "attn_q_norm",
                                                     "self_attn.k_norm": "attn_k_norm"},
                            metadata=write_qwen3_moe_metadata),
}


def _write_tokenizer(writer: Any, folder: Path, cfg: Any) -> None:
    """The byte-level BPE tokenizer of ``folder`` (tokenizer.json) as ``tokenizer.ggml.*`` keys."""
    vocab_model = json.loads((folder / "tokenizer.json").read_text())["model"]
    tokens = sorted(vocab_model["vocab"], key=vocab_model["vocab"].get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in vocab_model["merges"]])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id[0])


def _gguf_name(name: str, family: GgufFamily) -> str:
    if name.startswith("model.layers."):
        layer, rest = name[len("model.layers."):].split(".", 1)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{family.layer_names[module]}.{kind}"
    module, kind = name.rsplit(".", 1)
    return f"{family.global_names[module]}.{kind}"


def checkpoint_tensors(hf_model: Any) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) of the model's tensors as the converter sees them: transformers 5
    holds each block's experts fused in memory (``experts.gate_up_proj`` [experts, 2 x
    intermediate, hidden], gate rows first; ``experts.down_proj``), which come as the
    converter's merged stacks ``experts.gate_proj``, ``experts.up_proj``, ``experts.down_proj``."""
    for name, tensor in hf_model.state_dict().items():
        w = tensor.float().numpy()
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(w, 2, axis=1)
            yield name.replace("gate_up_proj", "gate_proj.weight"), gate
            yield name.replace("gate_up_proj", "up_proj.weight"), up
        elif name.endswith("mlp.experts.down_proj"):
            yield name + ".weight", w
        else:
            yield name, w


def write_gguf(hf_model: Any, folder: Path, path: Path, quantize=None) -> None:
    """Write ``hf_model`` (a tiny transformers model of a family in ``FAMILIES``) and the
    tokenizer of ``folder`` as a GGUF file the way llama.cpp's converter does.

    ``quantize(hf_name, float32 array)`` may return ``(uint8 block rows in the same row order,
    GGMLQuantizationType)`` to store a tensor quantized, or None to keep it F32."""
    import gguf

    cfg = hf_model.config
    family = FAMILIES[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch=family.arch)
    family.metadata(writer, cfg)
    _write_tokenizer(writer, folder, cfg)
    for name, w in checkpoint_tensors(hf_model):
        if name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", False):
            continue  # the converter writes no output.weight for tied embeddings
        if family.transform is not None:
            w = family.transform(name, w, cfg)
        # Quantized first, then permuted: the permutation moves whole rows, and ``quantize``
        # sees the rows in Hugging Face's order.
        stored = quantize(name, w) if quantize is not None else None
        raw_dtype = None
        if stored is not None:
            w, raw_dtype = stored
        if family.permute_qk and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif family.permute_qk and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        writer.add_tensor(_gguf_name(name, family), np.ascontiguousarray(w).copy(), raw_dtype=raw_dtype)
    if family.extra_tensors is not None:
        family.extra_tensors(writer, hf_model)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf_lora(peft_folder: Path, path: Path, cfg: Any) -> None:
    """Write the PEFT LoRA adapter in ``peft_folder`` (of a Llama-shaped base with config ``cfg``)
    as llama.cpp's convert_lora_to_gguf.py does: ``blk.N.<tensor>.weight.lora_a`` / ``.lora_b``,
    B's Q/K rows permuted like the base weights, ``adapter.lora.alpha`` (one alpha for all)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((peft_folder / "adapter_config.json").read_text())
    family = FAMILIES[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch=family.arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for name, w in sorted(load_file(str(peft_folder / "adapter_model.safetensors")).items()):
        module, which = name.removeprefix("base_model.model.").rsplit(".lora_", 1)
        which = which.split(".")[0].lower()  # "A.weight" -> "a"
        if which == "b" and family.permute_qk and module.endswith("self_attn.q_proj"):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif which == "b" and family.permute_qk and module.endswith("self_attn.k_proj"):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        writer.add_tensor(f"{_gguf_name(module + '.weight', family)}.lora_{which}", np.ascontiguousarray(w, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
