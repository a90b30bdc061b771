"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a flattened, paged batch."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torch import nn

from vpage import ops
from vpage.distributed.parallel_state import tp_rank, tp_size
from vpage.model_executor.forward_batch import ForwardBatch
from vpage.model_executor.layers.attention import PagedAttention
from vpage.model_executor.layers.linear import Embedding, Linear
from vpage.model_executor.layers.parallel_linear import (ColumnParallelLinear, RowParallelLinear, check_head_split,
                                                         kv_head_start, local_kv_heads)
from vpage.model_executor.layers.quant_linear import (QuantizedEmbedding, QuantizedLinear, QuantizedTensor,
                                                      QuantizedWeight)
from vpage.model_executor.layers.rms_norm import RMSNorm
from vpage.model_executor.layers.rotary import RotaryEmbedding
from vpage.model_executor.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from vpage.model_executor.models.cpu_decoder import CpuDecoder, eligible_for_cpu_decoder

KVCache = tuple[torch.Tensor, torch.Tensor]

# (fused parameter, checkpoint part, shard index) for projections stored fused here.
_STACKED = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


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
    """Fused QKV projection, rotary, paged attention, output projection.

    Under tensor parallelism (``tp_size() > 1``) this rank holds its query heads and its KV
    heads (a share, or one replicated head) in ``qkv_proj`` (column-parallel) and the
    matching input columns of ``o_proj`` (row-parallel: one all-reduce)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, qkv_bias: bool, o_bias: bool, layer_index: int = 0):
        super().__init__()
        rank, size = tp_rank(), tp_size()
        total_heads, total_kv_heads = hf_config.num_attention_heads, num_kv_heads_of(hf_config)
        check_head_split(total_heads, total_kv_heads, size)
        self.num_heads = total_heads // size
        self.num_kv_heads = local_kv_heads(total_kv_heads, size)
        self.head_size = head_size_of(hf_config)
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        kv_start = kv_head_start(total_kv_heads, rank, size) * self.head_size
        self.qkv_proj = ColumnParallelLinear(
            hf_config.hidden_size, [(rank * self.q_size, self.q_size), (kv_start, self.kv_size),
                                    (kv_start, self.kv_size)], qkv_bias, dtype)
        self.o_proj = RowParallelLinear(total_heads * self.head_size, hf_config.hidden_size, o_bias, dtype)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_size, self.head_size**-0.5,
                                   layer_index)

    def shard_sizes(self) -> list[int]:
        """Rows of the q, k and v parts inside ``qkv_proj``."""
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """x ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        rotary.rotate_(qkv, batch.positions, self.num_heads + self.num_kv_heads)  # q and k heads lead each row
        q, k, v = qkv.split(self.shard_sizes(), dim=-1)
        q = q.view(n, self.num_heads, self.head_size)
        k = k.view(n, self.num_kv_heads, self.head_size)
        v = v.view(n, self.num_kv_heads, self.head_size)
        return self.o_proj(self.attn(q, k, v, batch, kv_cache))


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one projection."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, bias: bool):
        super().__init__()
        size = tp_size()
        if hf_config.intermediate_size % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the intermediate size "
                             f"{hf_config.intermediate_size}")
        self.intermediate_size = hf_config.intermediate_size // size  # this rank's slice
        start = tp_rank() * self.intermediate_size
        part = (start, self.intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(hf_config.hidden_size, [part, part], bias, dtype)
        self.down_proj = RowParallelLinear(hf_config.intermediate_size, hf_config.hidden_size, bias, dtype)

    def shard_sizes(self) -> list[int]:
        """Rows of the gate and up parts inside ``gate_up_proj``."""
        return [self.intermediate_size, self.intermediate_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        gate_up = self.gate_up_proj(x)
        h = gate_up.new_empty(gate_up.shape[0], self.intermediate_size)
        ops.silu_and_mul(h, gate_up)
        return self.down_proj(h)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, residual adds fused into the norms."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 layer_index: int = 0):
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(hf_config, dtype, qkv_bias, o_bias, layer_index)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.mlp = LlamaMLP(hf_config, dtype, mlp_bias)

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


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, qkv_bias: bool, o_bias: bool, mlp_bias: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, dtype, qkv_bias, o_bias, mlp_bias, i)
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)
        theta, scaling = rope_settings(hf_config)
        self.rotary_emb = RotaryEmbedding(head_size_of(hf_config), theta, scaling,
                                          int(getattr(hf_config, "max_position_embeddings", 2048)))


class LlamaForCausalLM(nn.Module):
    """The model the engine calls: ``model(batch, kv_caches)`` then ``compute_logits``.

    Parameter names mirror Hugging Face's, except the fused ``qkv_proj``/``gate_up_proj``.
    """

    qkv_bias = False

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        # Whether forward may run the C++ layer loop (models/cpu_decoder.py) when the model
        # qualifies; tests turn it off to compare with the layer-by-layer path.
        self.use_cpu_decoder = True
        self._cpu_decoder: tuple[Any, Optional[CpuDecoder]] = (None, None)  # (caches it was built for, loop)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        self.model = LlamaModel(
            hf_config,
            dtype,
            qkv_bias=self.qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        )
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache]) -> torch.Tensor:
        """Run one step; returns final-normed hidden states ``[num_tokens, hidden_size]``.

        kv_caches: one (key_cache, value_cache) per layer, in ``vpage.ops``'s layout and
        this model's dtype. The step's K/V are written into the slots of ``batch``.
        """
        model = self.model
        layers = model.layers
        decoder = self._decoder_for(kv_caches)
        if decoder is not None and batch.layer_events is None:
            return decoder.forward(model.embed_tokens(batch.input_ids), batch)
        _check_caches(kv_caches, len(layers))
        h, residual = model.embed_tokens(batch.input_ids), None
        # The first layer's ops check the step's arguments; the other layers see the same
        # batch, activations of the same shapes and caches like the first layer's (checked
        # above), and their weights were checked at load: their ops skip the checks.
        h, residual = layers[0](h, residual, model.rotary_emb, batch, kv_caches[0])
        with ops.trusted_arguments():
            for i in range(1, len(layers)):
                h, residual = layers[i](h, residual, model.rotary_emb, batch, kv_caches[i])
            h, _ = model.norm(h, residual)
        return h

    def _decoder_for(self, kv_caches: list[KVCache]) -> Optional[CpuDecoder]:
        """The C++ layer loop for these caches (built on first use, kept while the caller
        passes the same list), or None when the model does not qualify."""
        if not self.use_cpu_decoder:
            return None
        caches, decoder = self._cpu_decoder
        if caches is not kv_caches:
            _check_caches(kv_caches, len(self.model.layers))
            decoder = CpuDecoder(self, kv_caches) if eligible_for_cpu_decoder(self, kv_caches) else None
            self._cpu_decoder = (kv_caches, decoder)
        return decoder

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[n, hidden_size]`` (rows to sample) -> logits ``[n, vocab_size]`` float32
        (under tensor parallelism: on rank 0; None on the other ranks)."""
        if isinstance(self.lm_head, QuantizedWeight):
            return self.lm_head.linear(hidden).float()
        return self.lm_head.logits(hidden)

    def keep_quantized(self, tensor_types: dict[str, int]) -> set[str]:
        """Swap each Linear/Embedding whose checkpoint weights (``tensor_types``: checkpoint
        name -> ggml type id) all have one type of ``ops.QUANT_TYPES`` for its quantized
        twin; a fused projection whose parts differ in type stays float (dequantized at load).
        Call before ``load_weights``; returns the checkpoint names to deliver as
        ``QuantizedTensor``s (the others come as float tensors, as before)."""
        by_id = {type_id: name for name, (type_id, _, _) in ops.QUANT_TYPES.items()}
        raw: set[str] = set()
        for module_name, module in list(self.named_modules()):
            if not isinstance(module, (Linear, Embedding)):
                continue
            parent_name, _, leaf = module_name.rpartition(".")
            parts = [part for fused, part, _ in _STACKED if fused == leaf] or [leaf]
            names = [f"{parent_name}.{part}.weight" if parent_name else f"{part}.weight" for part in parts]
            type_ids = {tensor_types.get(name) for name in names}
            qtype = by_id.get(type_ids.pop()) if len(type_ids) == 1 else None
            rows, cols = module.weight.shape
            if qtype is None or cols % ops.QUANT_TYPES[qtype][1]:
                continue
            if isinstance(module, Embedding):
                new: nn.Module = QuantizedEmbedding(rows, cols, self.dtype, qtype)
                if self.lm_head is module:
                    self.lm_head = new
            else:
                new = QuantizedLinear(cols, rows, module.bias is not None, self.dtype, qtype)
            setattr(self.get_submodule(parent_name) if parent_name else self, leaf, new)
            raw.update(names)
        return raw

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names, any float dtype, or QuantizedTensor
        rows for the modules ``keep_quantized`` swapped) into the parameters.

        Raises ValueError on an unknown name, a shape or type mismatch, or a parameter left unloaded.
        """
        params = dict(self.named_parameters())
        needed = set()
        for name in params:
            shards = [shard for fused, _, shard in _STACKED if f".{fused}." in name]
            needed.update((name, shard) for shard in shards or [None])
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if isinstance(tensor, QuantizedTensor):
                name = name.removesuffix("weight") + "qweight"
            param, rows, key = self._target(name, params)
            if isinstance(tensor, QuantizedTensor):
                tensor = self._quantized_rows(name, key[0], tensor)
            else:
                tensor = self._shard(key, tensor)
            dest = param.data if rows is None else param.data.narrow(0, *rows)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            needed.discard(key)
        if needed:
            names = sorted({name for name, _ in needed})
            raise ValueError(f"checkpoint lacks {len(needed)} tensors, e.g. for {names[:4]}")

    def _shard(self, key: tuple[str, int | None], tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole checkpoint tensor for the parameter ``key[0]``
        (part ``key[1]`` of a fused projection); the tensor itself without tensor parallelism."""
        param_name, part = key
        module = self.get_submodule(param_name.rpartition(".")[0])
        shard = getattr(module, "shard_checkpoint", None)
        if shard is None or tp_size() == 1:
            return tensor
        return shard(tensor, part or 0, param_name.endswith(".bias"))

    def _quantized_rows(self, name: str, param_name: str, tensor: QuantizedTensor) -> torch.Tensor:
        """The raw rows of ``tensor`` after checking its type against the module of ``param_name``."""
        module = self.get_submodule(param_name.rpartition(".")[0])
        if not isinstance(module, QuantizedWeight) or module.type_id != tensor.type_id or module.cols != tensor.cols:
            raise ValueError(f"checkpoint tensor {name!r} (ggml type {tensor.type_id}, {tensor.cols} columns) does "
                             f"not match the quantized parameter {param_name!r}")
        return tensor.data

    def _target(
        self, name: str, params: dict[str, nn.Parameter]
    ) -> tuple[nn.Parameter, tuple[int, int] | None, tuple[str, int | None]]:
        """(parameter, (row offset, rows) or None, loaded key) for a checkpoint tensor name."""
        for fused, part, shard in _STACKED:
            fused_name = name.replace(f".{part}.", f".{fused}.")
            if fused_name != name and fused_name in params:
                sizes = self.get_submodule(fused_name.rsplit(".", 2)[0]).shard_sizes()
                return params[fused_name], (sum(sizes[:shard]), sizes[shard]), (fused_name, shard)
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
        return params[name], None, (name, None)
