"""The C++ layer loop (``vpage._core._CpuDecoder``) for a Llama- or Gemma-structured model on
the CPU.

It implements two layer structures (``cpu_decoder_structure`` of the model class):
"llama", the pre-norm decoder layer (RMSNorm with the residual add fused in, fused QKV with
optional biases, optional per-head q/k RMSNorm, rotary, paged attention, gated MLP or a
mixture of experts: router, ``ops.fused_moe``, optionally a sigmoid-gated shared expert), and
"gemma", Gemma's layer (a norm before and after attention and MLP, the post-norms' outputs
joining the residual stream), each layer with its own sliding window, logit soft-cap and
rotary table (partial rotary included). A module runs on it only when its class states, in its
own body, what the loop does for it (``cpu_decoder_role``, see :func:`role_of`), and it has no
other child modules; so a family that adds a norm or changes a part runs its Python layers
until it says what the part is. Then the loop applies on the CPU when every projection is kept
in a GGUF block format (``QuantizedLinear``, float32 activations: the default model's case) or
packed for the dense kernel (``DenseWeight.pack``: float32, bfloat16 or float16 weights and
activations), the KV caches have the activations' dtype (or a 16-bit one under float32), every
layer's rotary has a static table and there is no tensor parallelism. It calls the kernels the
Python layers call, in the same order, so the hidden states are bitwise the Python path's;
what it saves is the interpreter's time between ~10 kernels per layer, most of a
single-stream decode step (see bench/RESULTS-llamacpp.md). The embedding lookup (and Gemma's
scaling of it) and the logits stay in Python. Projections that serve LoRA adapters (a
``lora_table`` that vpage.lora sets) get each token's adapter (``ForwardBatch.lora_token_slots``)
added in the loop right after their matmul, by the kernel ``ops.lora_add`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from vpage import _core, ops
from vpage._ops_cpu import DTYPE_CODES
from vpage.distributed.parallel_state import pp_size, tp_size
from vpage.model_executor.forward_batch import ForwardBatch
from vpage.model_executor.layers.attention import PagedAttention
from vpage.model_executor.layers.fused_moe import ExpertStack, FusedMoE
from vpage.model_executor.layers.linear import DenseWeight
from vpage.model_executor.layers.quant_linear import QuantizedLinear
from vpage.model_executor.layers.rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]
_INT32_MAX = 2**31 - 1


def role_of(module: nn.Module) -> Optional[str]:
    """What the C++ loop runs for ``module``: the ``cpu_decoder_role`` its class sets in its own
    body, or None. An inherited role does not count, so a subclass that changes what a part
    computes is off the loop until it states a role itself."""
    return vars(type(module)).get("cpu_decoder_role")


@dataclass(frozen=True)
class _Structure:
    code: int  # DecoderStructure in decoder_forward.h
    model_role: str
    layer_role: str
    norms: dict[str, str]  # a layer's [hidden_size] norms -> their names in _CpuDecoder's layer entries


_STRUCTURES = {
    "llama": _Structure(0, "llama_model", "llama_layer", {"input_layernorm": "input_norm",
                                                          "post_attention_layernorm": "post_attention_norm"}),
    "gemma": _Structure(1, "gemma_model", "gemma_layer", {"input_layernorm": "input_norm",
                                                          "post_attention_layernorm": "post_attention_norm",
                                                          "pre_feedforward_layernorm": "pre_feedforward_norm",
                                                          "post_feedforward_layernorm": "post_feedforward_norm"}),
}
_NORM_FIELDS = ("input_norm", "post_attention_norm", "pre_feedforward_norm", "post_feedforward_norm")
# attention role -> its child modules; the q/k norms are RMSNorms of [head_size] applied by
# ops.rms_norm_heads_ before the rotary (Qwen3, Gemma 3).
_ATTENTION_CHILDREN = {"attention": {"qkv_proj", "o_proj", "attn"},
                       "attention_qk_norm": {"qkv_proj", "o_proj", "attn", "q_norm", "k_norm"}}
# MLP role (one for every layer) -> MlpActivation in decoder_forward.h (a mixture of experts:
# SiLU experts); -> its child modules; -> MlpKind.
_ACTIVATION_CODES = {"silu_mlp": 0, "gelu_tanh_mlp": 1, "sparse_moe": 0}
_GATED = frozenset({"gate_up_proj", "down_proj"})
_MLP_CHILDREN = {"silu_mlp": (_GATED,), "gelu_tanh_mlp": (_GATED,),
                 "sparse_moe": ({"gate", "experts"}, {"gate", "experts", "shared_expert", "shared_expert_gate"})}
_MLP_KINDS = {"silu_mlp": 0, "gelu_tanh_mlp": 0, "sparse_moe": 1}
# A layer's LoRA entries -> the projection each one's table is on (owner module, projection).
_LORA_PROJECTIONS = (("lora_qkv", "self_attn", "qkv_proj"), ("lora_o", "self_attn", "o_proj"),
                     ("lora_gate_up", "mlp", "gate_up_proj"), ("lora_down", "mlp", "down_proj"))


def has_loop_structure(model: Any) -> bool:
    """Whether the modules of ``model`` (a LlamaForCausalLM or subclass) are the structure its
    class names in ``cpu_decoder_structure``, part by part (roles and child modules)."""
    structure = _STRUCTURES.get(getattr(model, "cpu_decoder_structure", None))
    inner = model.model
    if (structure is None or role_of(inner) != structure.model_role or role_of(inner.norm) != "rms_norm"
            or set(inner._modules) != {"embed_tokens", "layers", "norm", "rotary_emb"}):
        return False
    if not all(type(rotary) is RotaryEmbedding for rotary in _layer_rotaries(model)):
        return False
    if not all(_is_loop_layer(layer, structure) for layer in inner.layers):
        return False
    return len({role_of(layer.mlp) for layer in inner.layers}) == 1


def _is_loop_layer(layer: nn.Module, structure: _Structure) -> bool:
    if (role_of(layer) != structure.layer_role or set(layer._modules) != {*structure.norms, "self_attn", "mlp"}
            or not all(role_of(getattr(layer, name)) == "rms_norm" for name in structure.norms)):
        return False
    attn, mlp = layer.self_attn, layer.mlp
    children = _ATTENTION_CHILDREN.get(role_of(attn))
    if children is None or set(attn._modules) != children or type(attn.attn) is not PagedAttention:
        return False
    if "q_norm" in children and not role_of(attn.q_norm) == role_of(attn.k_norm) == "rms_norm":
        return False
    if set(mlp._modules) not in _MLP_CHILDREN.get(role_of(mlp), ()):
        return False
    if role_of(mlp) != "sparse_moe":
        return True
    if type(mlp.experts) is not FusedMoE or not isinstance(mlp.gate, DenseWeight):
        return False
    shared = mlp.shared_expert
    return shared is None or (role_of(shared) == "silu_mlp" and set(shared._modules) == _GATED
                              and isinstance(mlp.shared_expert_gate, DenseWeight))


def _layer_rotaries(model: Any) -> list[Any]:
    """Each layer's rotary: Gemma's ``layer_rotary`` (a table per layer type), else the one
    ``rotary_emb``."""
    inner = model.model
    if role_of(inner) == "gemma_model":
        return list(inner.layer_rotary)
    return [inner.rotary_emb] * len(inner.layers)


def _has_head_norms(attn: nn.Module) -> bool:
    return role_of(attn) == "attention_qk_norm"


def _linear_fields(name: str, layer: nn.Module) -> dict[str, int]:
    """A projection's entries: GGUF blocks (format 0) or packed dense weights (format 1)."""
    if isinstance(layer, QuantizedLinear):
        bias = layer.bias
        return {f"{name}_weight": layer.qweight.data_ptr(), f"{name}_format": 0, f"{name}_type": layer.type_id,
                f"{name}_bias": 0 if bias is None else bias.data_ptr()}
    bias = layer.packed_bias
    return {f"{name}_weight": layer.packed.data_ptr(), f"{name}_format": 1,
            f"{name}_dtype": DTYPE_CODES[layer.packed.dtype], f"{name}_bias": 0 if bias is None else bias.data_ptr()}


def _lora_modules(layer: nn.Module) -> dict[str, nn.Module]:
    """A layer's projections that serve LoRA adapters, by their LoRA entry (``lora_qkv``,
    ``lora_o``, ``lora_gate_up``, ``lora_down``): those with a ``lora_table`` (int64 ``[num_slots,
    5]``, ``ops.lora_add``'s table, updated in place) and its adapters' ``lora_dtype``, both set by
    vpage.lora. A mixture of experts' MLP has none."""
    found = {}
    for field, owner, name in _LORA_PROJECTIONS:
        module = getattr(getattr(layer, owner), name, None)
        if getattr(module, "lora_table", None) is not None:
            found[field] = module
    return found


def _lora_ok(model: Any) -> bool:
    """Whether the loop can read every LoRA table of ``model``: contiguous CPU int64 ``[num_slots,
    5]``, the same slot count and a float ``lora_dtype`` everywhere."""
    kinds = set()
    for layer in model.model.layers:
        for module in _lora_modules(layer).values():
            table = module.lora_table
            if (table.dtype != torch.int64 or table.device.type != "cpu" or table.dim() != 2
                    or table.shape[1] != ops.LORA_TABLE_WIDTH or not table.is_contiguous()):
                return False
            kinds.add((table.shape[0], getattr(module, "lora_dtype", None)))
    return len(kinds) <= 1 and all(dtype in DTYPE_CODES for _, dtype in kinds)


def _expert_fields(name: str, stack: ExpertStack) -> dict[str, int]:
    """An expert stack's entries: GGUF block rows (its ggml type) or packed float panels (-1)."""
    weights = stack.kernel_weights()
    return {f"{name}_data": weights.data_ptr(), f"{name}_expert_bytes": weights.stride(0) * weights.element_size(),
            f"{name}_type": -1 if stack.qtype is None else stack.type_id,
            f"{name}_dtype": DTYPE_CODES.get(weights.dtype, 0)}


def _mlp_fields(mlp: nn.Module) -> dict[str, int]:
    if role_of(mlp) == "sparse_moe":
        experts, shared = mlp.experts, mlp.shared_expert
        fields = {**_linear_fields("router", mlp.gate), **_expert_fields("w1", experts.w1),
                  **_expert_fields("w3", experts.w3), **_expert_fields("w2", experts.w2)}
        if shared is not None:
            fields.update({**_linear_fields("shared_gate_up", shared.gate_up_proj),
                           **_linear_fields("shared_down", shared.down_proj),
                           **_linear_fields("shared_gate", mlp.shared_expert_gate)})
        return fields
    return {**_linear_fields("gate_up", mlp.gate_up_proj), **_linear_fields("down", mlp.down_proj)}


def _mlp_shape(mlp: nn.Module) -> tuple:
    """What every layer's MLP must share: (intermediate size, experts, top_k, renormalize, the
    shared expert's intermediate size)."""
    if role_of(mlp) == "sparse_moe":
        experts, shared = mlp.experts, mlp.shared_expert
        return (experts.w1.rows, experts.num_experts, experts.top_k, experts.renormalize,
                0 if shared is None else shared.intermediate_size)
    return mlp.intermediate_size, 0, 0, False, 0


def _loop_mlp(mlp: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the loop runs ``mlp``'s projections: the gated MLP's, or the router's and the
    experts' (GGUF blocks, or float experts already packed)."""
    if role_of(mlp) != "sparse_moe":
        return _loop_projection(mlp.gate_up_proj, dtype) and _loop_projection(mlp.down_proj, dtype)
    stacks = (mlp.experts.w1, mlp.experts.w3, mlp.experts.w2)
    projections = [mlp.gate]
    if mlp.shared_expert is not None:
        projections += [mlp.shared_expert.gate_up_proj, mlp.shared_expert.down_proj, mlp.shared_expert_gate]
    return (all(_loop_projection(p, dtype) for p in projections)
            and all(s.qtype is not None or s.packed is not None for s in stacks))


def _loop_projection(layer: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the loop multiplies with ``layer``: GGUF blocks under float32 activations, or
    weights packed for the dense kernel."""
    if isinstance(layer, QuantizedLinear):
        return dtype == torch.float32
    return isinstance(layer, DenseWeight) and layer.packed is not None


def _hidden_norms(model: Any) -> list[nn.Module]:
    structure = _STRUCTURES[model.cpu_decoder_structure]
    return [model.model.norm] + [getattr(layer, name) for layer in model.model.layers for name in structure.norms]


def _head_norms(model: Any) -> list[nn.Module]:
    return [norm for layer in model.model.layers if _has_head_norms(layer.self_attn)
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm)]


def eligible_for_cpu_decoder(model: Any, kv_caches: list[KVCache]) -> bool:
    """Whether ``model`` (of a structure the loop implements: ``has_loop_structure``) with these
    caches can run on the C++ loop: dtypes, device, tensor parallelism, quantized projections,
    static rotary tables, and the sizes and epsilons the loop takes once for every layer."""
    dtype = model.dtype
    if dtype not in DTYPE_CODES or tp_size() != 1 or pp_size() != 1 or not kv_caches:
        return False
    key, value = kv_caches[0]
    if key.device.type != "cpu" or key.dtype not in DTYPE_CODES or value.dtype != key.dtype:
        return False
    if key.dtype != dtype and dtype != torch.float32:  # a 16-bit cache only under float32 activations
        return False
    layers = model.model.layers
    attn0, mlp0 = layers[0].self_attn, layers[0].mlp
    for layer, rotary in zip(layers, _layer_rotaries(model)):
        attn, mlp = layer.self_attn, layer.mlp
        if not (_loop_projection(attn.qkv_proj, dtype) and _loop_projection(attn.o_proj, dtype)
                and _loop_mlp(mlp, dtype)):
            return False
        if ((attn.num_heads, attn.num_kv_heads, attn.head_size, _mlp_shape(mlp))
                != (attn0.num_heads, attn0.num_kv_heads, attn0.head_size, _mlp_shape(mlp0))):
            return False
        # None for rope kinds without a static table (longrope, dynamic)
        cos_sin = rotary.cos_sin
        if (cos_sin is None or cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous()
                or rotary.head_size != attn.head_size or cos_sin.shape[1] != rotary.rotary_dim):
            return False
    return (len({norm.eps for norm in _hidden_norms(model)}) == 1 and len({norm.eps for norm in _head_norms(model)}) <= 1
            and _lora_ok(model))


class CpuDecoder:
    """Holds the C++ loop built for one model and one list of KV caches (the tensors it
    points into stay alive with the model and the caller's cache list)."""

    def __init__(self, model: Any, kv_caches: list[KVCache]):
        structure = _STRUCTURES[model.cpu_decoder_structure]
        layers = model.model.layers
        attn0, mlp0 = layers[0].self_attn, layers[0].mlp
        entries = []
        lora_modules = []
        for layer, rotary, (key_cache, value_cache) in zip(layers, _layer_rotaries(model), kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            norms = dict.fromkeys(_NORM_FIELDS, 0)  # 0: a norm the structure lacks
            norms.update({field: getattr(layer, name).weight.data_ptr() for name, field in structure.norms.items()})
            head_norms = ((attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()) if _has_head_norms(attn)
                          else (0, 0))
            # The values ops.rotary_embedding and ops.paged_attention hand their kernels.
            window, cap = attn.attn.sliding_window, attn.attn.logits_soft_cap
            lora = _lora_modules(layer)
            lora_modules += lora.values()
            entries.append({
                **norms, "q_norm": head_norms[0], "k_norm": head_norms[1],
                "cos_sin": rotary.cos_sin.data_ptr(), "max_position": rotary.cos_sin.shape[0],
                "rotary_dim": rotary.rotary_dim, "attention_scale": float(attn.attn.scale),
                "sliding_window": 0 if window is None else min(int(window), _INT32_MAX),
                "logits_soft_cap": 0.0 if cap is None else float(cap),
                "key_cache": key_cache.data_ptr(), "value_cache": value_cache.data_ptr(),
                **_linear_fields("qkv", attn.qkv_proj), **_linear_fields("o", attn.o_proj), **_mlp_fields(mlp),
                **{field: module.lora_table.data_ptr() for field, module in lora.items()},
            })
        num_blocks, _, _, block_size = kv_caches[0][1].shape
        norm = model.model.norm
        head_norms = _head_norms(model)
        self.hidden_size = norm.weight.shape[0]
        self.dtype = model.dtype
        self.kv_caches = kv_caches
        self.lora_tables = [module.lora_table for module in lora_modules]  # kept alive; vpage.lora updates them in place
        lora_dtype = DTYPE_CODES[lora_modules[0].lora_dtype] if lora_modules else 0
        intermediate_size, num_experts, top_k, renormalize, shared_intermediate_size = _mlp_shape(mlp0)
        self._decoder = _core._CpuDecoder(
            structure=structure.code, activation=_ACTIVATION_CODES[role_of(mlp0)], hidden_size=self.hidden_size,
            num_heads=attn0.num_heads, num_kv_heads=attn0.num_kv_heads, head_size=attn0.head_size,
            intermediate_size=intermediate_size, rms_norm_eps=norm.eps,
            head_norm_eps=head_norms[0].eps if head_norms else norm.eps, final_norm=norm.weight.data_ptr(),
            num_blocks=num_blocks, block_size=block_size, dtype=DTYPE_CODES[model.dtype],
            cache_dtype=DTYPE_CODES[kv_caches[0][0].dtype],
            layers=entries, mlp=_MLP_KINDS[role_of(mlp0)], num_experts=num_experts, top_k=top_k,
            renormalize=renormalize, shared_intermediate_size=shared_intermediate_size,
            num_lora_slots=self.lora_tables[0].shape[0] if self.lora_tables else 0, lora_dtype=lora_dtype)

    def forward(self, embeddings: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states ``[num_tokens, hidden_size]`` for ``batch`` whose token
        embeddings are ``embeddings`` (``[num_tokens, hidden_size]`` of the model's dtype)."""
        _check_batch(embeddings, batch, self.hidden_size, self.dtype)
        out = torch.empty_like(embeddings)
        decode = batch.is_decode
        lora_token_slots = getattr(batch, "lora_token_slots", None)
        self._decoder.forward(
            embeddings.data_ptr(), out.data_ptr(), batch.positions.data_ptr(), batch.slot_mapping.data_ptr(),
            batch.block_tables.data_ptr(), batch.context_lens.data_ptr(),
            0 if decode else batch.query_start_loc.data_ptr(), num_tokens=embeddings.shape[0],
            num_seqs=batch.context_lens.shape[0], max_blocks_per_seq=batch.block_tables.shape[1],
            max_context_len=batch.max_context_len, num_threads=ops.get_num_threads(),
            draft_queries=batch.draft_queries,
            lora_token_slots=0 if lora_token_slots is None else lora_token_slots.data_ptr())
        return out


def _check_batch(embeddings: torch.Tensor, batch: ForwardBatch, hidden_size: int, dtype: torch.dtype) -> None:
    """The layouts the C++ loop reads (values are checked by its kernels)."""
    n, seqs = embeddings.shape[0], batch.context_lens.shape[0]
    expected = ((embeddings, dtype, (n, hidden_size)), (batch.positions, torch.int64, (n,)),
                (batch.slot_mapping, torch.int64, (n,)), (batch.context_lens, torch.int32, (seqs,)),
                (batch.block_tables, torch.int32, (seqs, batch.block_tables.shape[-1])),
                (batch.query_start_loc, torch.int32, (seqs + 1,)))
    lora_token_slots = getattr(batch, "lora_token_slots", None)
    if lora_token_slots is not None:
        expected += ((lora_token_slots, torch.int32, (n,)),)
    for tensor, dtype, shape in expected:
        if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise ValueError(f"step input of shape {tuple(tensor.shape)} and dtype {tensor.dtype} does not match "
                             f"the expected contiguous {dtype} {shape}")

