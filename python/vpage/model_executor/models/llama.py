"""Llama-family decoder (Llama, SmolLM2, Mistral) over a flattened, paged batch; the base that
other dense families (models/qwen2.py) build on by swapping parts.

A decoder layer is assembled from the parts of ``DecoderParts`` (attention, MLP, norm); each
linear and embedding layer is quantized or float from construction (``QuantConfig``), named
by its module path so the config can tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from vpage import ops
from vpage.distributed.parallel_state import is_first_stage, is_last_stage, stage_layers
from vpage.model_executor.forward_batch import ForwardBatch
from vpage.model_executor.layer_types import sliding_windows
from vpage.model_executor.layers.attention import PagedAttention
from vpage.model_executor.layers.parallel_linear import OutputRows
from vpage.model_executor.layers.quantization import QuantConfig
from vpage.model_executor.layers.rms_norm import RMSNorm
from vpage.model_executor.layers.rotary import RotaryEmbedding, rope_max_positions
from vpage.model_executor.layers.weight_utils import shard_ids_of, weight_loader_of
from vpage.model_executor.models.arch import GgufArch, ModelArch
from vpage.model_executor.models.cpu_decoder import CpuDecoder, eligible_for_cpu_decoder, has_loop_structure

KVCache = tuple[torch.Tensor, torch.Tensor]


def head_size_of(hf_config: Any) -> int:
    """Per-head size: ``head_dim`` when the config sets it, else hidden / heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return head_dim or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads_of(hf_config: Any) -> int:
    """Key/value heads (GQA); equal to the query heads when the config omits it."""
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def rope_settings(hf_config: Any) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from a transformers 4.x or 5.x config."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return float(params.get("rope_theta", 10000.0)), dict(params)
    return float(getattr(hf_config, "rope_theta", 10000.0)), getattr(hf_config, "rope_scaling", None)


def layer_sliding_window(hf_config: Any, layer_index: int) -> int | None:
    """The sliding window of layer ``layer_index`` (``layer_types.sliding_windows``), or None
    when it has none or one no shorter than the longest context (``max_position_embeddings``,
    stretched by dynamic NTK or YaRN rope), which then masks nothing (tiny Mistral configs keep
    transformers' default of 4096)."""
    window = sliding_windows(hf_config)[layer_index]
    max_position = getattr(hf_config, "max_position_embeddings", None)
    if max_position:
        max_position = rope_max_positions(int(max_position), rope_settings(hf_config)[1])
    return None if window is None or (max_position and window >= max_position) else window


def _check_caches(kv_caches: list[KVCache], num_layers: int) -> None:
    """One (key_cache, value_cache) per layer, each with layer 0's shapes, dtype and device."""
    if len(kv_caches) != num_layers:
        raise ValueError(f"expected {num_layers} KV caches, got {len(kv_caches)}")
    key0, value0 = kv_caches[0]
    for i, (key, value) in enumerate(kv_caches):
        if (key.shape != key0.shape or value.shape != value0.shape or key.dtype != key0.dtype
                or value.dtype != value0.dtype or key.device != key0.device or value.device != value0.device
                or not key.is_contiguous() or not value.is_contiguous()):
            raise ValueError(f"layer {i}'s KV cache differs from layer 0's in shape, dtype, device or layout")


class LlamaAttention(nn.Module):
    """Fused QKV projection, rotary on the query and key heads, paged attention, output
    projection.

    Under tensor parallelism this rank holds its query heads and its KV heads (a share, or one
    replicated head) in ``qkv_proj`` (column-parallel) and the matching input columns of
    ``o_proj`` (row-parallel: one all-reduce)."""

    # What the C++ layer loop runs for this class (models/cpu_decoder.py, role_of: a subclass
    # states its own role or runs the Python layers).
    cpu_decoder_role = "attention"

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant: QuantConfig, prefix: str, layer_index: int,
                 qkv_bias: bool = False):
        """qkv_bias: biases on Q, K and V (Qwen2); Llama's ``attention_bias`` turns on every
        attention bias."""
        super().__init__()
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        self.head_size = head_size_of(hf_config)
        rows = OutputRows.qkv(self.head_size, hf_config.num_attention_heads, num_kv_heads_of(hf_config))
        self.q_size, self.kv_size, _ = rows.sizes
        self.num_heads = self.q_size // self.head_size
        self.num_kv_heads = self.kv_size // self.head_size
        self.qkv_proj = quant.column_linear(f"{prefix}.qkv_proj", hf_config.hidden_size, rows,
                                            qkv_bias or attention_bias, dtype)
        self.o_proj = quant.row_linear(f"{prefix}.o_proj", hf_config.num_attention_heads * self.head_size,
                                       hf_config.hidden_size, attention_bias, dtype)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_size, self.head_size**-0.5,
                                   layer_index, sliding_window=layer_sliding_window(hf_config, layer_index))

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """x ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        n = x.shape[0]
        # Views of the QKV rows (row-strided, contiguous columns): the steps below work in place.
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        self.position_qk(q, k, rotary, batch)
        return self.o_proj(self.attn(q.view(n, self.num_heads, self.head_size),
                                     k.view(n, self.num_kv_heads, self.head_size),
                                     v.view(n, self.num_kv_heads, self.head_size), batch, kv_cache))

    def position_qk(self, q: torch.Tensor, k: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch) -> None:
        """Rotate the query and key heads in place (a family with a per-head q/k norm, like
        Qwen3, normalises them here first). Rotating q and k apart is bitwise rotating them
        together: the kernel works head by head."""
        rotary.rotate_(q, batch, self.num_heads)
        rotary.rotate_(k, batch, self.num_kv_heads)


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one projection."""

    cpu_decoder_role = "silu_mlp"

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant: QuantConfig, prefix: str):
        super().__init__()
        bias = bool(getattr(hf_config, "mlp_bias", False))
        size = hf_config.intermediate_size
        rows = OutputRows.split([size, size], [0, 1])
        self.intermediate_size = rows.sizes[0]  # this rank's slice
        self.gate_up_proj = quant.column_linear(f"{prefix}.gate_up_proj", hf_config.hidden_size, rows, bias, dtype)
        self.down_proj = quant.row_linear(f"{prefix}.down_proj", size, hf_config.hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        gate_up = self.gate_up_proj(x)
        h = gate_up.new_empty(gate_up.shape[0], self.intermediate_size)
        ops.silu_and_mul(h, gate_up)
        return self.down_proj(h)


def llama_norm(hf_config: Any, dtype: torch.dtype) -> nn.Module:
    """The hidden-state norm of a layer (and the final one): RMSNorm with a fused residual add."""
    return RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)


@dataclass(frozen=True)
class DecoderParts:
    """What a decoder layer is made of; a family changes the parts it does differently.

    attention(hf_config, dtype, quant, prefix, layer_index) and mlp(hf_config, dtype, quant,
    prefix) map ``[num_tokens, hidden]`` to the same (attention also takes the rotary, the
    batch and the layer's KV cache); norm(hf_config, dtype) is called as ``norm(x, residual)
    -> (normed, residual)`` like :class:`RMSNorm`."""

    attention: Callable[..., nn.Module] = LlamaAttention
    mlp: Callable[..., nn.Module] = LlamaMLP
    norm: Callable[[Any, torch.dtype], nn.Module] = llama_norm


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, residual adds fused into the norms."""

    cpu_decoder_role = "llama_layer"

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant: QuantConfig, prefix: str, layer_index: int,
                 parts: DecoderParts):
        super().__init__()
        self.input_layernorm = parts.norm(hf_config, dtype)
        self.self_attn = parts.attention(hf_config, dtype, quant, f"{prefix}.self_attn", layer_index)
        self.post_attention_layernorm = parts.norm(hf_config, dtype)
        self.mlp = parts.mlp(hf_config, dtype, quant, f"{prefix}.mlp")

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        batch: ForwardBatch,
        kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (block output, residual stream), both ``[num_tokens, hidden_size]``."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rotary, batch, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class AbsentLayer(nn.Module):
    """A decoder layer that another pipeline stage holds: no weights, never called."""


class StageParts:
    """Which parts of a model this pipeline stage builds (all of them with one stage): its
    ranges of decoder layers (``ranges``: one, or several with interleaved virtual stages), the
    embedding on the first stage (and on the last when the output projection is tied to it),
    the final norm and the output projection on the last (which runs the last range)."""

    def __init__(self, hf_config: Any):
        self.ranges = stage_layers(hf_config.num_hidden_layers)
        self.first, self.last = is_first_stage(), is_last_stage()
        self.embedding = self.first or (self.last and bool(getattr(hf_config, "tie_word_embeddings", False)))
        # Layer i's KV cache is entry cache_start[r] + i - start of the stage's caches (range r).
        self.cache_start = [sum(e - s for s, e in self.ranges[:r]) for r in range(len(self.ranges))]
        self.num_layers = sum(e - s for s, e in self.ranges)

    def holds(self, layer_index: int) -> bool:
        return any(start <= layer_index < end for start, end in self.ranges)

    def layers(self, hf_config: Any, make_layer: Callable[[int], nn.Module]) -> nn.ModuleList:
        """The decoder layers by their global index; another stage's are ``AbsentLayer``s."""
        return nn.ModuleList(make_layer(i) if self.holds(i) else AbsentLayer()
                             for i in range(hf_config.num_hidden_layers))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm (every layer rotates with ``rotary_emb``);
    under pipeline parallelism the stage's parts of them (``StageParts``; the others None)."""

    cpu_decoder_role = "llama_model"

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant: QuantConfig, prefix: str, parts: DecoderParts):
        super().__init__()
        self.stage = StageParts(hf_config)
        self.embed_tokens = quant.embedding(f"{prefix}.embed_tokens", hf_config.vocab_size, hf_config.hidden_size,
                                            dtype) if self.stage.embedding else None
        self.layers = self.stage.layers(
            hf_config, lambda i: LlamaDecoderLayer(hf_config, dtype, quant, f"{prefix}.layers.{i}", i, parts))
        self.norm = parts.norm(hf_config, dtype) if self.stage.last else None
        theta, scaling = rope_settings(hf_config)
        self.rotary_emb = RotaryEmbedding(head_size_of(hf_config), theta, scaling,
                                          int(getattr(hf_config, "max_position_embeddings", 2048)))


class LlamaForCausalLM(nn.Module):
    """The model the engine calls: ``model(batch, kv_caches)`` then ``compute_logits``.

    Parameter names mirror Hugging Face's, except the fused ``qkv_proj``/``gate_up_proj``
    (and ``qweight`` for a weight kept quantized).
    """

    arch = ModelArch(
        architectures=("LlamaForCausalLM", "MistralForCausalLM"),
        model_types={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"},
        gguf=GgufArch("llama", "LlamaConfig", permuted_qk=True),
    )
    parts = DecoderParts()
    # Builds ``self.model`` as ``model_class(hf_config, dtype, quant, "model", parts)``: a family
    # whose layer stack differs from Llama's (Gemma) swaps the whole stack.
    model_class: Callable[..., nn.Module] = LlamaModel
    # The layer structure of the C++ layer loop (models/cpu_decoder.py) this class is: "llama",
    # "gemma" or None (the Python layers only). The loop runs only when every module is a part
    # it implements for that structure (``has_cpu_decoder_structure``).
    cpu_decoder_structure: Optional[str] = "llama"

    def __init__(self, hf_config: Any, dtype: torch.dtype, quant: QuantConfig | None = None):
        super().__init__()
        quant = quant or QuantConfig()
        self.dtype = dtype
        # Whether forward may run the C++ layer loop when the model qualifies; tests turn it
        # off to compare with the layer-by-layer path.
        self.use_cpu_decoder = True
        self._cpu_decoder: tuple[Any, Optional[CpuDecoder]] = (None, None)  # (caches it was built for, loop)
        self.model = self.model_class(hf_config, dtype, quant, "model", self.parts)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if not self.model.stage.last:
            self.lm_head = None
        elif self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = quant.lm_head("lm_head", hf_config.vocab_size, hf_config.hidden_size, dtype)
        # Checkpoint names of the parts other pipeline stages hold (their weights are skipped).
        self.absent_prefixes = tuple(
            [f"model.{name}." for name in ("embed_tokens", "norm") if getattr(self.model, name) is None]
            + [f"model.layers.{i}." for i, layer in enumerate(self.model.layers) if isinstance(layer, AbsentLayer)]
            + (["lm_head."] if self.lm_head is None else []))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache],
                intermediate: Optional[torch.Tensor] = None, layer_range: int = 0) -> torch.Tensor:
        """Run one step; returns final-normed hidden states ``[num_tokens, hidden_size]``.

        kv_caches: one (key_cache, value_cache) per layer of this stage, in ``vpage.ops``'s
        layout and this model's dtype. The step's K/V are written into the slots of ``batch``.
        Under pipeline parallelism this runs the stage's range ``layer_range`` of layers: from
        ``intermediate`` unless it starts the model, and returning its own unless it ends it:
        ``[2, num_tokens, hidden_size]``, the last layer's block output and residual stream.
        """
        model = self.model
        decoder = self._decoder_for(kv_caches)
        if decoder is not None and batch.layer_events is None:
            return decoder.forward(model.embed_tokens(batch.input_ids), batch)
        if intermediate is None:
            return self.run_layers(model.embed_tokens(batch.input_ids), None, batch, kv_caches)
        return self.run_layers(intermediate[0], intermediate[1], batch, kv_caches, layer_range)

    def rotary_of(self, layer_index: int) -> RotaryEmbedding:
        return self.model.rotary_emb

    def run_layers(self, h: torch.Tensor, residual: Optional[torch.Tensor], batch: ForwardBatch,
                   kv_caches: list[KVCache], layer_range: int = 0) -> torch.Tensor:
        """The stage's range ``layer_range`` of decoder layers over ``h`` (+ ``residual``), then
        the final norm where the range ends the model; else the ``[2, num_tokens, hidden_size]``
        stack of both streams."""
        stage = self.model.stage
        layers = self.model.layers
        start, end = stage.ranges[layer_range]
        caches = kv_caches[stage.cache_start[layer_range]:]
        _check_caches(kv_caches, stage.num_layers)
        # The first layer's ops check the step's arguments; the other layers see the same
        # batch, activations of the same shapes and caches like the first layer's (checked
        # above), and their weights were checked at load: their ops skip the checks.
        h, residual = layers[start](h, residual, self.rotary_of(start), batch, caches[0])
        with ops.trusted_arguments():
            for i in range(start + 1, end):
                h, residual = layers[i](h, residual, self.rotary_of(i), batch, caches[i - start])
            if not stage.last or layer_range != len(stage.ranges) - 1:
                return torch.stack((h, residual))
            h, _ = self.model.norm(h, residual)
        return h

    def has_cpu_decoder_structure(self) -> bool:
        """Whether this model is the structure the C++ layer loop implements: the class names
        one (``cpu_decoder_structure``) and every module is a part of it (its class states its
        role for the loop; no extra children)."""
        return has_loop_structure(self)

    def _decoder_for(self, kv_caches: list[KVCache]) -> Optional[CpuDecoder]:
        """The C++ layer loop for these caches (built on first use, kept while the caller
        passes the same list), or None when the model does not qualify."""
        if not self.use_cpu_decoder:
            return None
        caches, decoder = self._cpu_decoder
        if caches is not kv_caches:
            _check_caches(kv_caches, self.model.stage.num_layers)
            eligible = self.has_cpu_decoder_structure() and eligible_for_cpu_decoder(self, kv_caches)
            decoder = CpuDecoder(self, kv_caches) if eligible else None
            self._cpu_decoder = (kv_caches, decoder)
        return decoder

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden ``[n, hidden_size]`` (rows to sample) -> logits ``[n, vocab_size]`` float32
        (under tensor parallelism: on rank 0; None on the other ranks). ``out``: a contiguous
        float32 ``[n, vocab_size]`` buffer the logits are written into when the activations are
        float32 on one rank (a caller's reused buffer saves allocating, faulting in and freeing
        n x vocab floats every step); the result is ``out`` or a new tensor."""
        if out is not None and hidden.dtype != torch.float32:
            out = None
        return self.lm_head.logits(hidden, out)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load checkpoint tensors (Hugging Face names; float tensors of any dtype, or
        ``QuantizedTensor``s) through each parameter's weight loader.

        Raises ValueError on an unknown name, a shape or type mismatch, or a parameter left unloaded.
        """
        params = dict(self.named_parameters())
        loaded: dict[str, set] = {name: set() for name in params}
        for name, tensor in weights:
            if not name.startswith(("model.", "lm_head.")) and self.arch.param_for(name) is not None:
                name = "model." + name  # a base model's checkpoint (Qwen3-Embedding's: saved as Qwen3Model)
            target = self.arch.param_for(name)
            if target is None or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            param_name, shard_id = target
            if param_name not in params and param_name.endswith(".weight"):
                param_name = param_name.removesuffix("weight") + "qweight"  # a weight kept quantized
            if param_name not in params:
                if param_name.startswith(self.absent_prefixes):
                    continue  # another pipeline stage's
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            param = params[param_name]
            try:
                weight_loader_of(param)(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r} {e}") from e
            loaded[param_name].add(shard_id)
        missing = [name for name, param in params.items() if None not in loaded[name]
                   for shard_id in shard_ids_of(param) if shard_id not in loaded[name]]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. for {sorted(set(missing))[:4]}")
