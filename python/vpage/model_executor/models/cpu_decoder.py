"""The C++ layer loop (``vpage._core._CpuDecoder``) for a Llama-structured model on the CPU.

It implements one structure, the plain Llama decoder layer (RMSNorm, fused QKV with optional
biases, rotary, paged attention, SiLU-gated MLP): only a model whose
``has_cpu_decoder_structure()`` says so takes it (the class opts in and its parts are exactly
those), so a family that adds a norm or changes the MLP runs its Python layers. Then it
applies when every projection is kept in a GGUF block format (``QuantizedLinear``), the
activations are float32 (KV caches float32, float16 or bfloat16) on the CPU and there is no
tensor parallelism: the default model's case. It calls the kernels the Python layers call, in
the same order, so the hidden states are bitwise the Python path's; what it saves is the
interpreter's time between ~10 kernels per layer, most of a single-stream decode step (see
bench/RESULTS-llamacpp.md).
"""

from __future__ import annotations

from typing import Any

import torch

from vpage import _core, ops
from vpage._ops_cpu import DTYPE_CODES
from vpage.distributed.parallel_state import tp_size
from vpage.model_executor.forward_batch import ForwardBatch
from vpage.model_executor.layers.quant_linear import QuantizedLinear

KVCache = tuple[torch.Tensor, torch.Tensor]


def _linear_fields(name: str, layer: QuantizedLinear) -> dict[str, int]:
    bias = layer.bias
    return {f"{name}_weight": layer.qweight.data_ptr(), f"{name}_type": layer.type_id,
            f"{name}_bias": 0 if bias is None else bias.data_ptr()}


def eligible_for_cpu_decoder(model: Any, kv_caches: list[KVCache]) -> bool:
    """Whether ``model`` (of the structure the loop implements) with these caches can run on
    the C++ loop: dtypes, device, tensor parallelism and quantized projections."""
    if model.dtype != torch.float32 or tp_size() != 1 or not kv_caches:
        return False
    key, value = kv_caches[0]
    if key.device.type != "cpu" or key.dtype not in DTYPE_CODES or value.dtype != key.dtype:
        return False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(p, QuantizedLinear) for p in parts):
            return False
    cos_sin = model.model.rotary_emb.cos_sin  # None for rope kinds without a static table (longrope, dynamic)
    return cos_sin is not None and cos_sin.dtype == torch.float32 and cos_sin.shape[1] == attn.head_size


class CpuDecoder:
    """Holds the C++ loop built for one model and one list of KV caches (the tensors it
    points into stay alive with the model and the caller's cache list)."""

    def __init__(self, model: Any, kv_caches: list[KVCache]):
        layers = model.model.layers
        attn0 = layers[0].self_attn
        entries = []
        for layer, (key_cache, value_cache) in zip(layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            entries.append({
                "input_norm": layer.input_layernorm.weight.data_ptr(),
                "post_attention_norm": layer.post_attention_layernorm.weight.data_ptr(),
                "key_cache": key_cache.data_ptr(), "value_cache": value_cache.data_ptr(),
                **_linear_fields("qkv", attn.qkv_proj), **_linear_fields("o", attn.o_proj),
                **_linear_fields("gate_up", mlp.gate_up_proj), **_linear_fields("down", mlp.down_proj),
            })
        num_blocks, _, _, block_size = kv_caches[0][1].shape
        cos_sin = model.model.rotary_emb.cos_sin
        norm = model.model.norm
        self.hidden_size = norm.weight.shape[0]
        self.kv_caches = kv_caches
        self._decoder = _core._CpuDecoder(
            hidden_size=self.hidden_size, num_heads=attn0.num_heads, num_kv_heads=attn0.num_kv_heads,
            head_size=attn0.head_size, intermediate_size=layers[0].mlp.intermediate_size,
            rms_norm_eps=norm.eps, attention_scale=attn0.attn.scale, cos_sin=cos_sin.data_ptr(),
            max_position=cos_sin.shape[0], final_norm=norm.weight.data_ptr(), num_blocks=num_blocks,
            block_size=block_size, cache_dtype=DTYPE_CODES[kv_caches[0][0].dtype], layers=entries)

    def forward(self, embeddings: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states ``[num_tokens, hidden_size]`` for ``batch`` whose token
        embeddings are ``embeddings`` (float32 ``[num_tokens, hidden_size]``)."""
        _check_batch(embeddings, batch, self.hidden_size)
        out = torch.empty_like(embeddings)
        decode = batch.is_decode
        self._decoder.forward(
            embeddings.data_ptr(), out.data_ptr(), batch.positions.data_ptr(), batch.slot_mapping.data_ptr(),
            batch.block_tables.data_ptr(), batch.context_lens.data_ptr(),
            0 if decode else batch.query_start_loc.data_ptr(), num_tokens=embeddings.shape[0],
            num_seqs=batch.context_lens.shape[0], max_blocks_per_seq=batch.block_tables.shape[1],
            max_context_len=batch.max_context_len, num_threads=ops.get_num_threads())
        return out


def _check_batch(embeddings: torch.Tensor, batch: ForwardBatch, hidden_size: int) -> None:
    """The layouts the C++ loop reads (values are checked by its kernels)."""
    n, seqs = embeddings.shape[0], batch.context_lens.shape[0]
    expected = ((embeddings, torch.float32, (n, hidden_size)), (batch.positions, torch.int64, (n,)),
                (batch.slot_mapping, torch.int64, (n,)), (batch.context_lens, torch.int32, (seqs,)),
                (batch.block_tables, torch.int32, (seqs, batch.block_tables.shape[-1])),
                (batch.query_start_loc, torch.int32, (seqs + 1,)))
    for tensor, dtype, shape in expected:
        if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise ValueError(f"step input of shape {tuple(tensor.shape)} and dtype {tensor.dtype} does not match "
                             f"the expected contiguous {dtype} {shape}")

