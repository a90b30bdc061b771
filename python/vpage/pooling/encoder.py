"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) over packed sequences.

Absolute position and token type embeddings, post-LayerNorm layers (attention, then a GELU
MLP, each added to its input and normalised), bidirectional attention within each sequence.
The projections are ``Linear`` layers (packed for ``ops.dense_matmul`` on the CPU), Q, K and
V fused into one. Activations live in a ``Workspace`` reused by every layer and step: matmuls
write into it, GELU, residual adds and LayerNorms work in place.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vpage.model_executor.layers.linear import Linear
from vpage.model_executor.layers.parallel_linear import ColumnParallelLinear, OutputRows
from vpage.model_executor.layers.weight_utils import ShardId, empty_parameter
from vpage.pooling.attention import packed_attention
from vpage.pooling.batch import PackedBatch
from vpage.pooling.workspace import Workspace

# In place (the MLP's intermediate activations are the largest tensors of a step).
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": torch.ops.aten.gelu_,  # exact (erf)
    "gelu_new": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "gelu_fast": lambda x: torch.ops.aten.gelu_(x, approximate="tanh"),
    "relu": torch.relu_,
}
# Checkpoint names inside ``encoder.layer.{i}.`` -> (this layer's module, shard of a fused one).
_LAYER_PARTS = {
    "attention.self.query": ("qkv", "q"), "attention.self.key": ("qkv", "k"), "attention.self.value": ("qkv", "v"),
    "attention.output.dense": ("attn_out", None), "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("ffn_in", None), "output.dense": ("ffn_out", None), "output.LayerNorm": ("ffn_norm", None),
}
_LAYER_NAME = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")


def layer_norm_into(norm: nn.LayerNorm, x: torch.Tensor, out: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """``out = norm(x)`` (x, out ``[n, hidden]``, not the same tensor), without allocating."""
    n = x.shape[0]
    stats = [ws.get(name, n, 1, x.dtype, x.device) for name in ("norm_mean", "norm_rstd")]
    torch.ops.aten.native_layer_norm.out(x, list(norm.normalized_shape), norm.weight, norm.bias, norm.eps,
                                         out0=out, out1=stats[0], out2=stats[1])
    return out


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """An in-place activation by transformers' name; ValueError naming the supported ones."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class EncoderEmbeddings(nn.Module):
    """Word + position + token type embeddings, then LayerNorm."""

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        hidden = hf_config.hidden_size
        self.word_embeddings = empty_parameter(hf_config.vocab_size, hidden, dtype=dtype)
        self.position_embeddings = empty_parameter(hf_config.max_position_embeddings, hidden, dtype=dtype)
        self.token_type_embeddings = empty_parameter(max(1, getattr(hf_config, "type_vocab_size", 1)), hidden,
                                                     dtype=dtype)
        self.norm = nn.LayerNorm(hidden, eps=hf_config.layer_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """Each ``[num_tokens]`` int64 -> ``[num_tokens, hidden_size]``."""
        x = F.embedding(input_ids, self.word_embeddings)
        x += F.embedding(positions, self.position_embeddings)
        x += F.embedding(token_type_ids, self.token_type_embeddings)
        return self.norm(x)


class EncoderLayer(nn.Module):
    """Self-attention (fused QKV, output projection, residual, LayerNorm), then the MLP
    (up, activation, down, residual, LayerNorm)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype):
        super().__init__()
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        self.num_heads, self.head_size = heads, hidden // heads
        eps = hf_config.layer_norm_eps
        self.qkv = ColumnParallelLinear(hidden, OutputRows.qkv(self.head_size, heads, heads), True, dtype)
        self.attn_out = Linear(hidden, hidden, True, dtype)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.ffn_in = Linear(hidden, hf_config.intermediate_size, True, dtype)
        self.ffn_out = Linear(hf_config.intermediate_size, hidden, True, dtype)
        self.ffn_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.act = activation(getattr(hf_config, "hidden_act", "gelu"))

    def forward(self, x: torch.Tensor, batch: PackedBatch, ws: Workspace,
                rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """x ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]`` in ``ws``'s "hidden" buffer
        (x may be that buffer: it is read before the output is written); with ``rows`` (one per
        sequence), only those rows' outputs ``[len(rows), hidden]`` (every token is still a key)."""
        hidden = self.num_heads * self.head_size
        n, dtype, device = x.shape[0], x.dtype, x.device
        qkv = self.qkv.matmul(x, out=ws.get("qkv", n, 3 * hidden, dtype, device))
        q, k, v = qkv.split([hidden, hidden, hidden], dim=-1)
        if rows is None:
            q_starts, q_lens, suffix = batch.starts, batch.lens, ""
        else:
            index = torch.tensor(rows, dtype=torch.int64, device=device)
            q, x, n = q[index], x[index], len(rows)
            q_starts, q_lens, suffix = range(n), [1] * n, "_rows"
        attn = packed_attention(q, k, v, batch.starts, batch.lens, q_starts, q_lens, self.num_heads, self.head_size,
                                out=ws.get("attn" + suffix, n, hidden, dtype, device))
        h = self.attn_out.matmul(attn, out=ws.get("residual" + suffix, n, hidden, dtype, device)).add_(x)
        mid = layer_norm_into(self.attn_norm, h, ws.get("mid" + suffix, n, hidden, dtype, device), ws)
        up = self.act(self.ffn_in.matmul(mid, out=ws.get("ffn" + suffix, n, self.ffn_in.weight_shape[0], dtype,
                                                         device)))
        h = self.ffn_out.matmul(up, out=ws.get("residual" + suffix, n, hidden, dtype, device)).add_(mid)
        return layer_norm_into(self.ffn_norm, h, ws.get("hidden" + suffix, n, hidden, dtype, device), ws)


class Encoder(nn.Module):
    """Embeddings and layers of a BERT-family encoder. RoBERTa and XLM-R count positions
    from ``padding_idx + 1`` (``position_offset``), BERT from 0."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, padding_positions: bool):
        super().__init__()
        self.padding_idx = int(getattr(hf_config, "pad_token_id", 0) or 0) if padding_positions else None
        self.position_offset = 0 if self.padding_idx is None else self.padding_idx + 1
        self.embeddings = EncoderEmbeddings(hf_config, dtype)
        self.layers = nn.ModuleList(EncoderLayer(hf_config, dtype) for _ in range(hf_config.num_hidden_layers))
        self.workspace = Workspace()

    def forward(self, batch: PackedBatch, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The last hidden states ``[num_tokens, hidden]``, or only ``rows``' (one per sequence);
        a view of the workspace, valid until the next forward."""
        positions = batch.positions() if self.padding_idx is None else batch.padding_aware_positions(self.padding_idx)
        x = self.embeddings(batch.input_ids, positions, batch.token_type_ids)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, self.workspace, rows if i == last else None)
        return x

    def param_for(self, name: str) -> Optional[tuple[str, ShardId]]:
        """(parameter name, shard) for a checkpoint name without its model prefix ("bert."),
        None for a name this encoder has no use for (buffers, other heads)."""
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if name.startswith("embeddings."):
            part = name.removeprefix("embeddings.")
            if part in ("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight"):
                return f"embeddings.{part.removesuffix('.weight')}", None
            if part in ("LayerNorm.weight", "LayerNorm.bias"):
                return f"embeddings.norm.{part.split('.')[-1]}", None
            return None  # position_ids buffers
        match = _LAYER_NAME.match(name)
        if match is None or match.group(2) not in _LAYER_PARTS:
            return None
        module, shard = _LAYER_PARTS[match.group(2)]
        return f"layers.{match.group(1)}.{module}.{match.group(3)}", shard
