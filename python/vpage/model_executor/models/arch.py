"""What the loader needs to know about one model architecture beside its class: the names it
goes by, how checkpoint tensors map onto its parameters, and how a GGUF file describes it.

A model class carries its description as ``arch``; the registry (``models/__init__.py``)
indexes the classes by every name of their descriptions. The defaults are the Llama-shaped
ones, so a dense family that only changes layers states its names and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol

from vpage.model_executor.layers.weight_utils import ShardId

# (fused parameter, checkpoint part, shard id): projections a Llama-shaped model stores fused.
# A checkpoint that ships them fused already (Phi-3's qkv_proj) names the parameter itself.
LLAMA_STACKED_PARAMS: tuple[tuple[str, str, ShardId], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
LLAMA_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class GgufMetadata(Protocol):
    """The view of a GGUF file's metadata a config mapping reads (``loader/gguf_config.py``)."""

    def get(self, key: str, default: Any = ...) -> Any:
        """``{architecture}.{key}``; ValueError when missing and no default is given."""

    def get_global(self, key: str, default: Any = ...) -> Any:
        """A key outside the architecture's namespace (``tokenizer.ggml.*``)."""

    def has_tensor(self, name: str) -> bool:
        """Whether the file holds a tensor of that GGUF name."""

    def tensor_values(self, name: str) -> list[float]:
        """The values of a small tensor (rope factors) as floats."""


_GGUF_ROPE_TYPES = ("none", "linear", "yarn", "longrope")


def _gguf_yarn(meta: GgufMetadata) -> dict:
    """YaRN as Hugging Face states it. llama.cpp multiplies a stored attention or
    extrapolation factor into its own YaRN terms, which Hugging Face's parameters cannot
    express: such files are refused."""
    for key in ("rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor", "rope.scaling.attn_factor"):
        if meta.get(key, None) is not None:
            raise ValueError(f"GGUF YaRN rope with {key} is not supported")
    scaling = {"rope_type": "yarn", "factor": float(meta.get("rope.scaling.factor")),
               "original_max_position_embeddings": int(meta.get("rope.scaling.original_context_length"))}
    for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if (value := meta.get(key, None)) is not None:
            scaling[name] = float(value)
    return scaling


def _gguf_rope_scaling(meta: GgufMetadata) -> dict | None:
    """The rope scaling of the metadata (Hugging Face's ``rope_parameters`` keys, plus
    ``freq_factors`` for llama.cpp's ``rope_freqs`` per-frequency divisors); ValueError for
    kinds vpage does not implement.

    Long/short factor tensors (Phi-3's converter writes them without a scaling type) are
    longrope; ``rope_freqs`` (Llama 3.1+: the converter's llama3 scaling baked into one factor
    per frequency) divides the frequencies of a default or linear rope."""
    kind = meta.get("rope.scaling.type", "none")
    if kind not in _GGUF_ROPE_TYPES:
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (supported: {', '.join(_GGUF_ROPE_TYPES)})")
    scaling = None
    if meta.has_tensor("rope_factors_long.weight") or meta.has_tensor("rope_factors_short.weight"):
        scaling = {"rope_type": "longrope", "long_factor": meta.tensor_values("rope_factors_long.weight"),
                   "short_factor": meta.tensor_values("rope_factors_short.weight"),
                   "original_max_position_embeddings": int(meta.get("rope.scaling.original_context_length"))}
        if (attention := meta.get("rope.scaling.attn_factor", None)) is not None:
            scaling["attention_factor"] = float(attention)
    elif kind == "longrope":
        raise ValueError("GGUF longrope scaling without rope_factors_long/rope_factors_short tensors")
    elif kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta.get("rope.scaling.factor"))}
    elif kind == "yarn":
        scaling = _gguf_yarn(meta)
    if meta.has_tensor("rope_freqs.weight"):
        if scaling is not None and scaling["rope_type"] != "linear":
            raise ValueError(f"GGUF rope_freqs with {scaling['rope_type']} scaling is not supported")
        scaling = {**(scaling or {"rope_type": "default"}), "freq_factors": meta.tensor_values("rope_freqs.weight")}
    return scaling


def llama_gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    """transformers config fields of a Llama-shaped model from llama.cpp's metadata keys."""
    heads = int(meta.get("attention.head_count"))
    hidden = int(meta.get("embedding_length"))
    vocab = meta.get("vocab_size", None)
    if vocab is None:
        vocab = len(meta.get_global("tokenizer.ggml.tokens"))
    return dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(meta.get("feed_forward_length")),
        num_hidden_layers=int(meta.get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get("attention.head_count_kv", heads)),
        head_dim=int(meta.get("attention.key_length", hidden // heads)),
        max_position_embeddings=int(meta.get("context_length")),
        rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(meta),
        tie_word_embeddings=not meta.has_tensor("output.weight"),
        bos_token_id=meta.get_global("tokenizer.ggml.bos_token_id", None),
        eos_token_id=meta.get_global("tokenizer.ggml.eos_token_id", None),
    )


@dataclass(frozen=True)
class GgufArch:
    """How a GGUF file (``general.architecture == name``) holds the architecture."""

    name: str  # e.g. "llama", "qwen2"
    config_class: str  # the transformers config class its metadata fills, e.g. "LlamaConfig"
    # Whether llama.cpp's converter interleaved the Q/K rows of each head (it does for "llama").
    permuted_qk: bool = False
    config_fields: Callable[[GgufMetadata], dict[str, Any]] = llama_gguf_config
    layer_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_LAYER_NAMES)
    global_names: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_GLOBAL_NAMES)
    # (Hugging Face name, tensor) -> the tensor as the Hugging Face checkpoint holds it, undoing
    # what the converter changed beyond names and the Q/K permutation (Gemma: norms stored + 1).
    tensor_transform: Optional[Callable[[str, Any], Any]] = None
    # For a variant of another class's architecture name (Mixtral: "llama" with experts): whether
    # a file's metadata is this variant's. None: the class the name stands for.
    matches: Optional[Callable[[GgufMetadata], bool]] = None


@dataclass(frozen=True)
class ModelArch:
    """One architecture family: its Hugging Face names and how its checkpoints load."""

    architectures: tuple[str, ...]  # Hugging Face ``architectures`` names the class serves
    model_types: Mapping[str, str]  # HF model_type -> architecture, for a config without ``architectures``
    gguf: Optional[GgufArch] = None
    stacked_params: tuple[tuple[str, str, ShardId], ...] = LLAMA_STACKED_PARAMS
    ignored_weights: tuple[str, ...] = ("rotary_emb.inv_freq",)  # checkpoint names containing these are skipped

    def param_for(self, name: str) -> Optional[tuple[str, ShardId]]:
        """(parameter name, shard id) a Hugging Face checkpoint tensor loads into, or None
        for a tensor the model does not use."""
        if any(ignored in name for ignored in self.ignored_weights):
            return None
        for fused, part, shard_id in self.stacked_params:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard_id
        return name, None
