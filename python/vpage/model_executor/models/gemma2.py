"""Gemma 2, and the layer stack Gemma 3 (models/gemma3.py) shares with it.

What differs from Llama: the embeddings are scaled by sqrt(hidden_size); every RMSNorm
multiplies by ``1 + w``; each block is normed before and after (input / post-attention norm
around attention, pre- / post-feedforward norm around the MLP), and the post-norm's output is
what joins the residual stream; the MLP is GELU-tanh gated; attention scales by
``query_pre_attn_scalar ** -0.5``, soft-caps its logits and, on the layers ``layer_types``
names "sliding_attention", sees only a sliding window; the final logits are soft-capped
(``cap * tanh(logits / cap)``); the embeddings are tied (as Gemma's configs default).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from vpage import ops
from vpage.model_executor.forward_batch import ForwardBatch
from vpage.model_executor.layers.attention import PagedAttention
from vpage.model_executor.layers.quantization import QuantConfig
from vpage.model_executor.layers.rms_norm import RMSNorm
from vpage.model_executor.layers.rotary import RotaryEmbedding
from vpage.model_executor.layers.weight_utils import ShardId, copy_checked, float_tensor, set_weight_loader
from vpage.model_executor.models.arch import ModelArch
from vpage.model_executor.models.gemma_gguf import GEMMA2_GGUF
from vpage.model_executor.models.llama import (DecoderParts, KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP,
                                               StageParts, head_size_of, layer_sliding_window, rope_settings)

# transformers' names of the tanh approximation of GELU (they differ only in rounding).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new", "gelu_fast")


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, ``x / sqrt(mean(x^2) + eps) * (1 + w)`` with statistics in float32.

    The parameter holds ``1 + w`` (added in float32 at load), so :class:`RMSNorm`'s kernels
    (and the fused residual add) apply unchanged. In float32 that is transformers' computation;
    in bfloat16/float16 ``1 + w`` is rounded to the dtype and the normalised rows are rounded
    before the product, where transformers multiplies in float32 and rounds once: up to two more
    roundings of the dtype per element (``1 + w`` in bfloat16 keeps w to 2^-8 for |1 + w| < 2)."""

    cpu_decoder_role = "rms_norm"  # RMSNorm's kernel on the stored 1 + w

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__(hidden_size, eps, dtype)
        set_weight_loader(self.weight, _load_one_plus)

    def normed_(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the rows of ``x`` ``[num_tokens, hidden_size]`` (contiguous) in place."""
        ops.rms_norm(x, x, self.weight, self.eps)
        return x


def _load_one_plus(param: nn.Parameter, loaded: Any, shard_id: ShardId) -> None:
    """A checkpoint's Gemma norm weight ``w`` into the parameter as ``1 + w``."""
    if shard_id is not None:
        raise ValueError(f"is part {shard_id!r} of a parameter that has no parts")
    copy_checked(param.data, float_tensor(loaded).float() + 1)


def gemma_norm(hf_config: Any, dtype: torch.dtype) -> GemmaRMSNorm:
    return GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)


class GemmaMLP(LlamaMLP):
    """``down(gelu_tanh(gate(x)) * up(x))`` with gate and up fused into one projection."""

    cpu_decoder_role = "gelu_tanh_mlp"

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant: QuantConfig, prefix: str):
        act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
        if act not in _GELU_TANH:
            raise ValueError(f"unsupported Gemma activation {act!r} (supported: {', '.join(_GELU_TANH)})")
        super().__init__(hf_config, dtype, quant, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        gate_up = self.gate_up_proj(x)
        h = gate_up.new_empty(gate_up.shape[0], self.intermediate_size)
        ops.gelu_tanh_and_mul(h, gate_up)
        return self.down_proj(h)


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's scale ``query_pre_attn_scalar ** -0.5``, the layer's
    sliding window (from ``layer_types``) and the attention logit soft-cap."""

    cpu_decoder_role = "attention"  # the scale, window and soft-cap are read from ``attn``

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant: QuantConfig, prefix: str, layer_index: int):
        super().__init__(hf_config, dtype, quant, prefix, layer_index)
        scale = float(hf_config.query_pre_attn_scalar) ** -0.5
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_size, scale, layer_index,
                                   sliding_window=layer_sliding_window(hf_config, layer_index),
                                   logits_soft_cap=self.logits_soft_cap(hf_config))

    @staticmethod
    def logits_soft_cap(hf_config: Any) -> Optional[float]:
        """The attention logit soft-cap (None or 0: none)."""
        cap = getattr(hf_config, "attn_logit_softcapping", None)
        return float(cap) if cap else None


class GemmaDecoderLayer(nn.Module):
    """Normed attention then normed MLP, each block normed before and after; the post-norm
    output joins the residual stream, an add fused into the next pre-norm (the MLP's, the next
    layer's input norm, or the final norm)."""

    cpu_decoder_role = "gemma_layer"  # the C++ loop's DecoderStructure::kGemma: keep the two alike

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant: QuantConfig, prefix: str, layer_index: int,
                 parts: DecoderParts):
        super().__init__()
        self.input_layernorm = parts.norm(hf_config, dtype)
        self.self_attn = parts.attention(hf_config, dtype, quant, f"{prefix}.self_attn", layer_index)
        self.post_attention_layernorm = parts.norm(hf_config, dtype)
        self.pre_feedforward_layernorm = parts.norm(hf_config, dtype)
        self.mlp = parts.mlp(hf_config, dtype, quant, f"{prefix}.mlp")
        self.post_feedforward_layernorm = parts.norm(hf_config, dtype)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        batch: ForwardBatch,
        kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input is ``x + residual`` (``x`` alone when residual is None); returns
        (block output, residual stream), both ``[num_tokens, hidden_size]``, whose sum is its output."""
        h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm.normed_(self.self_attn(h, rotary, batch, kv_cache))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm.normed_(self.mlp(h)), residual


def rope_per_layer_type(hf_config: Any) -> Optional[dict[str, tuple[float, dict]]]:
    """(rope_theta, rope parameters) per transformers layer type when ``rope_parameters``
    holds one per type (Gemma 3: "sliding_attention", "full_attention"); None when one rope
    serves every layer (Gemma 2)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    kinds = set(getattr(hf_config, "layer_types", None) or ())
    if not kinds or not all(isinstance(params.get(kind), dict) for kind in kinds):
        return None
    return {kind: (float(params[kind].get("rope_theta", 10000.0)), dict(params[kind])) for kind in sorted(kinds)}


class GemmaModel(nn.Module):
    """Embedding (scaled by sqrt(hidden_size)), decoder layers, the final norm, and a rotary
    table per rope of the layer types (``layer_rotary[i]``: layer i's)."""

    cpu_decoder_role = "gemma_model"

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant: QuantConfig, prefix: str, parts: DecoderParts):
        super().__init__()
        self.stage = StageParts(hf_config)
        self.embed_tokens = quant.embedding(f"{prefix}.embed_tokens", hf_config.vocab_size, hf_config.hidden_size,
                                            dtype) if self.stage.embedding else None
        # transformers multiplies by sqrt(hidden_size) rounded to the model dtype (55.5, not
        # 55.43, for 3072 in bfloat16).
        self.register_buffer("embed_scale", torch.tensor(hf_config.hidden_size**0.5).to(dtype), persistent=False)
        self.layers = self.stage.layers(
            hf_config, lambda i: GemmaDecoderLayer(hf_config, dtype, quant, f"{prefix}.layers.{i}", i, parts))
        self.norm = parts.norm(hf_config, dtype) if self.stage.last else None
        head_size = head_size_of(hf_config)
        max_position = int(getattr(hf_config, "max_position_embeddings", 8192))
        per_type = rope_per_layer_type(hf_config)
        if per_type is None:
            self.rotary_emb = RotaryEmbedding(head_size, *rope_settings(hf_config), max_position)
            rotaries = [self.rotary_emb] * len(self.layers)
        else:
            self.rotary_emb = nn.ModuleDict({kind: RotaryEmbedding(head_size, theta, params, max_position)
                                             for kind, (theta, params) in per_type.items()})
            rotaries = [self.rotary_emb[kind] for kind in hf_config.layer_types]
        self.layer_rotary: list[RotaryEmbedding] = rotaries  # references, registered once above


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 over a flattened, paged batch (the C++ layer loop's Gemma structure when it
    qualifies, as Llama's forward; else the Python layers)."""

    arch = ModelArch(
        architectures=("Gemma2ForCausalLM",),
        model_types={"gemma2": "Gemma2ForCausalLM"},
        gguf=GEMMA2_GGUF,
    )
    parts = DecoderParts(attention=GemmaAttention, mlp=GemmaMLP, norm=gemma_norm)
    model_class = GemmaModel
    cpu_decoder_structure = "gemma"

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant: QuantConfig | None = None):
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not supported: "
                             "vpage's attention is causal")
        super().__init__(hf_config, dtype, quant)
        cap = getattr(hf_config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(cap) if cap else None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache],
                intermediate: Optional[torch.Tensor] = None, layer_range: int = 0) -> torch.Tensor:
        """Run one step (as Llama's forward, pipeline stages included); the embedding is scaled."""
        model = self.model
        if intermediate is not None:
            return self.run_layers(intermediate[0], intermediate[1], batch, kv_caches, layer_range)
        h = model.embed_tokens(batch.input_ids).mul_(model.embed_scale)
        decoder = self._decoder_for(kv_caches)
        if decoder is not None and batch.layer_events is None:
            return decoder.forward(h, batch)
        return self.run_layers(h, None, batch, kv_caches)

    def rotary_of(self, layer_index: int) -> RotaryEmbedding:
        return self.model.layer_rotary[layer_index]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Llama's logits (float32, see there), then ``cap * tanh(logits / cap)`` in place."""
        logits = super().compute_logits(hidden, out)
        cap = self.final_logit_softcapping
        if cap is not None and logits is not None:
            logits.div_(cap).tanh_().mul_(cap)
        return logits
