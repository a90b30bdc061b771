"""ModernBERT encoders (transformers' ``ModernBertModel``) over packed sequences.

Token embeddings and LayerNorm (no position embeddings), then pre-LayerNorm layers (the first
layer's attention norm is the identity): fused QKV, rotary embeddings, bidirectional attention
over the whole sequence in global layers (every ``global_attn_every_n_layers``-th, from the
first) and within ``local_attention // 2`` tokens either side in the others, each with its own
rotary base; a GeGLU MLP (``Wi`` -> input, gate -> ``act(input) * gate`` -> ``Wo``); a final
LayerNorm. Activations live in the ``Workspace`` as in ``encoder.py``.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vpage.model_executor.layers.linear import Linear
from vpage.model_executor.layers.weight_utils import ShardId, empty_parameter
from vpage.pooling.attention import packed_attention
from vpage.pooling.batch import PackedBatch
from vpage.pooling.encoder import activation, layer_norm_into
from vpage.pooling.workspace import Workspace

GLOBAL, LOCAL = "full_attention", "sliding_attention"  # transformers' layer types
_DEFAULT_THETA = {GLOBAL: 160_000.0, LOCAL: 10_000.0}
_OLD_THETA_NAMES = {GLOBAL: "global_rope_theta", LOCAL: "local_rope_theta"}
# Checkpoint names inside ``layers.{i}.`` -> this layer's module.
_LAYER_PARTS = {"attn_norm": "attn_norm", "attn.Wqkv": "wqkv", "attn.Wo": "wo", "mlp_norm": "mlp_norm",
                "mlp.Wi": "wi", "mlp.Wo": "wo_mlp"}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)$")


def layer_types(hf_config: Any) -> list[str]:
    """Each layer's attention, GLOBAL or LOCAL: the config's ``layer_types`` (transformers 5),
    else global every ``global_attn_every_n_layers`` layers from the first."""
    types = getattr(hf_config, "layer_types", None)
    if types:
        return list(types)
    every = int(getattr(hf_config, "global_attn_every_n_layers", 3))
    return [LOCAL if i % every else GLOBAL for i in range(hf_config.num_hidden_layers)]


def rope_theta(hf_config: Any, layer_type: str) -> float:
    """The rotary base of a layer type: ``rope_parameters[type]["rope_theta"]`` (transformers 5),
    else ``global_rope_theta`` / ``local_rope_theta``. ValueError for a scaled rotary."""
    params = (getattr(hf_config, "rope_parameters", None) or {}).get(layer_type)
    if params:
        if params.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {params['rope_type']!r} is not supported (only 'default')")
        if "rope_theta" in params:
            return float(params["rope_theta"])
    return float(getattr(hf_config, _OLD_THETA_NAMES[layer_type], _DEFAULT_THETA[layer_type]))


def layer_norm(hf_config: Any, dtype: torch.dtype) -> nn.LayerNorm:
    return nn.LayerNorm(hf_config.hidden_size, eps=hf_config.norm_eps, bias=bool(hf_config.norm_bias), dtype=dtype)


def rotary(positions: torch.Tensor, theta: float, head_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(cos, sin) ``[num_tokens, 1, head_size]`` float32 (rounded through ``dtype``, as
    transformers does) of each token's position."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.float) / head_size))
    freqs = positions[:, None].float() * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).float().unsqueeze(1), emb.sin().to(dtype).float().unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_size: int) -> torch.Tensor:
    """x ``[n, heads * head_size]`` (rows may be strided) rotated, ``[n, heads * head_size]`` in x's dtype."""
    h = x.reshape(-1, num_heads, head_size).float()
    half = head_size // 2
    rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    return (h * cos + rotated * sin).to(x.dtype).view(x.shape[0], -1)


class ModernBertLayer(nn.Module):
    """x + attn(attn_norm(x)), then + mlp(mlp_norm(.)); attention global or within ``window``."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, index: int, local: bool):
        super().__init__()
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        self.num_heads, self.head_size = heads, hidden // heads
        self.window = int(hf_config.local_attention) // 2 if local else None
        attn_bias, mlp_bias = bool(hf_config.attention_bias), bool(hf_config.mlp_bias)
        self.attn_norm = None if index == 0 else layer_norm(hf_config, dtype)
        self.wqkv = Linear(hidden, 3 * hidden, attn_bias, dtype)
        self.wo = Linear(hidden, hidden, attn_bias, dtype)
        self.mlp_norm = layer_norm(hf_config, dtype)
        self.intermediate = int(hf_config.intermediate_size)
        self.wi = Linear(hidden, 2 * self.intermediate, mlp_bias, dtype)
        self.wo_mlp = Linear(self.intermediate, hidden, mlp_bias, dtype)
        self.act = activation(getattr(hf_config, "hidden_activation", "gelu"))

    def forward(self, x: torch.Tensor, batch: PackedBatch, ws: Workspace, rope: tuple[torch.Tensor, ...],
                rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """x ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]`` in ``ws``'s "hidden" buffer
        (x may be that buffer); with ``rows`` (one per sequence, in sequence order) only those
        rows' outputs ``[len(rows), hidden]`` (every token is still a key)."""
        hidden = self.num_heads * self.head_size
        n, dtype, device = x.shape[0], x.dtype, x.device
        h = x if self.attn_norm is None else layer_norm_into(self.attn_norm, x, ws.get("normed", n, hidden, dtype,
                                                                                          device), ws)
        qkv = self.wqkv.matmul(h, out=ws.get("qkv", n, 3 * hidden, dtype, device))
        q, k, v = qkv.split([hidden, hidden, hidden], dim=-1)
        cos, sin = rope
        q = apply_rotary(q, cos, sin, self.num_heads, self.head_size)
        k = apply_rotary(k, cos, sin, self.num_heads, self.head_size)
        if rows is None:
            q_starts, q_lens, q_offsets, suffix = batch.starts, batch.lens, None, ""
        else:
            index = torch.tensor(rows, dtype=torch.int64, device=device)
            q, x, n = q[index], x[index], len(rows)
            q_starts, q_lens, suffix = range(n), [1] * n, "_rows"
            q_offsets = [row - start for row, start in zip(rows, batch.starts)]
        attn = packed_attention(q, k, v, batch.starts, batch.lens, q_starts, q_lens, self.num_heads, self.head_size,
                                out=ws.get("attn" + suffix, n, hidden, dtype, device), window=self.window,
                                q_offsets=q_offsets)
        h = self.wo.matmul(attn, out=ws.get("residual" + suffix, n, hidden, dtype, device)).add_(x)
        mid = layer_norm_into(self.mlp_norm, h, ws.get("mid" + suffix, n, hidden, dtype, device), ws)
        up = self.wi.matmul(mid, out=ws.get("ffn" + suffix, n, 2 * self.intermediate, dtype, device))
        gated = ws.get("glu" + suffix, n, self.intermediate, dtype, device)
        torch.mul(self.act(up[:, :self.intermediate]), up[:, self.intermediate:], out=gated)
        return self.wo_mlp.matmul(gated, out=ws.get("hidden" + suffix, n, hidden, dtype, device)).add_(h)


class ModernBertEmbeddings(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        self.tok_embeddings = empty_parameter(hf_config.vocab_size, hf_config.hidden_size, dtype=dtype)
        self.norm = layer_norm(hf_config, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(F.embedding(input_ids, self.tok_embeddings))


class ModernBertEncoder(nn.Module):
    """Embeddings, layers and the final norm; positions count from 0 in each sequence
    (``padding_positions`` is BERT's and is ignored)."""

    position_offset = 0

    def __init__(self, hf_config: Any, dtype: torch.dtype, padding_positions: bool = False):
        super().__init__()
        types = layer_types(hf_config)
        if len(types) != hf_config.num_hidden_layers or set(types) - {GLOBAL, LOCAL}:
            raise ValueError(f"layer_types must be {hf_config.num_hidden_layers} of {GLOBAL!r} / {LOCAL!r}, "
                             f"got {types}")
        self.layer_types = types
        self.theta = {t: rope_theta(hf_config, t) for t in set(types)}
        self.head_size = hf_config.hidden_size // hf_config.num_attention_heads
        self.embeddings = ModernBertEmbeddings(hf_config, dtype)
        self.layers = nn.ModuleList(ModernBertLayer(hf_config, dtype, i, t == LOCAL) for i, t in enumerate(types))
        self.final_norm = layer_norm(hf_config, dtype)
        self.workspace = Workspace()

    def forward(self, batch: PackedBatch, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The last hidden states ``[num_tokens, hidden]``, or only ``rows``' (one per sequence)."""
        x = self.embeddings(batch.input_ids)
        positions = batch.positions()
        rope = {t: rotary(positions, theta, self.head_size, x.dtype) for t, theta in self.theta.items()}
        last = len(self.layers) - 1
        for i, (layer, kind) in enumerate(zip(self.layers, self.layer_types)):
            x = layer(x, batch, self.workspace, rope[kind], rows if i == last else None)
        return self.final_norm(x)

    def param_for(self, name: str) -> Optional[tuple[str, ShardId]]:
        """(parameter name, shard) for a checkpoint name without its model prefix ("model."),
        None for a name this encoder has no use for."""
        if name in ("embeddings.tok_embeddings.weight", "embeddings.norm.weight", "embeddings.norm.bias",
                    "final_norm.weight", "final_norm.bias"):
            return name.replace("tok_embeddings.weight", "tok_embeddings"), None
        match = _LAYER_NAME.match(name)
        if match is None or match.group(2) not in _LAYER_PARTS:
            return None
        return f"layers.{match.group(1)}.{_LAYER_PARTS[match.group(2)]}.{match.group(3)}", None
