"""What the mixture-of-experts families share: the sparse MLP block (a replicated router, the
experts of ``FusedMoE``, optionally Qwen2-MoE's shared expert with its sigmoid gate) and the
description that maps per-expert checkpoint names onto the expert stacks.

Under tensor parallelism the router is whole on every rank, the experts (and the shared
expert's MLP) hold this rank's slice of their intermediate dimension, and the block sums the
ranks' partial outputs with one all-reduce at its end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from vpage import ops
from vpage.distributed.parallel_state import all_reduce, tp_size
from vpage.model_executor.layers.fused_moe import FusedMoE
from vpage.model_executor.layers.linear import Linear
from vpage.model_executor.layers.parallel_linear import OutputRows
from vpage.model_executor.layers.quant_linear import QuantizedWeight
from vpage.model_executor.layers.quantization import QuantConfig
from vpage.model_executor.layers.weight_utils import ShardId
from vpage.model_executor.models.arch import GgufMetadata, ModelArch, llama_gguf_config

# experts.{e}.{part}. in a checkpoint name -> the stack it fills (Qwen's names and Mixtral's).
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.")
_STACK_OF = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}
_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class MoeModelArch(ModelArch):
    """A ModelArch whose per-expert checkpoint tensors (``mlp.experts.{e}.gate_proj.weight``)
    load into the expert stacks (``mlp.experts.w1.weight``, shard ``e``); ``block_name`` is the
    checkpoint's name of the sparse block when it is not ``mlp`` (Mixtral: block_sparse_moe)."""

    block_name: str = "mlp"

    def param_for(self, name: str) -> Optional[tuple[str, ShardId]]:
        if self.block_name != "mlp":
            name = name.replace(f".{self.block_name}.", ".mlp.")
        m = _EXPERT_RE.search(name)
        if m is not None:
            stack = _STACK_OF[m.group(2)]
            return name[:m.start()] + f".experts.{stack}." + name[m.end():], int(m.group(1))
        return super().param_for(name)


def gguf_moe_layer_names(block: str) -> dict[str, str]:
    """llama.cpp's MoE tensors (after "blk.N.") -> Hugging Face names (after "model.layers.N."),
    the sparse block being ``block``: the router and the merged expert stacks (``ffn_gate_exps``
    [experts, intermediate, hidden] and so on, loaded whole), and Qwen2-MoE's shared expert."""
    return {
        "ffn_gate_inp": f"{block}.gate",
        "ffn_gate_exps": f"{block}.experts.w1",
        "ffn_up_exps": f"{block}.experts.w3",
        "ffn_down_exps": f"{block}.experts.w2",
        "ffn_gate_inp_shexp": f"{block}.shared_expert_gate",
        "ffn_gate_shexp": f"{block}.shared_expert.gate_proj",
        "ffn_up_shexp": f"{block}.shared_expert.up_proj",
        "ffn_down_shexp": f"{block}.shared_expert.down_proj",
    }


def gguf_moe_config(meta: GgufMetadata, experts_key: str) -> dict[str, Any]:
    """llama_gguf_config plus the experts: ``experts_key`` (the config's name for the expert
    count), ``num_experts_per_tok`` and, for the layers without a router tensor,
    ``mlp_only_layers`` (llama.cpp has no key for them)."""
    fields = llama_gguf_config(meta)
    fields[experts_key] = int(meta.get("expert_count"))
    fields["num_experts_per_tok"] = int(meta.get("expert_used_count"))
    dense = [i for i in range(fields["num_hidden_layers"]) if not meta.has_tensor(f"blk.{i}.ffn_gate_inp.weight")]
    if dense:
        fields["mlp_only_layers"] = dense
    return fields


def gguf_shared_gate_as_row(name: str, tensor: Any) -> Any:
    """Qwen2-MoE's shared expert gate as Hugging Face's ``[1, hidden]`` (a converter may store it
    as ``[hidden]``)."""
    if name.endswith("shared_expert_gate.weight") and isinstance(tensor, torch.Tensor) and tensor.dim() == 1:
        return tensor.unsqueeze(0)
    return tensor


def layer_index_of(prefix: str) -> int:
    """The layer index in a module path such as ``model.layers.3.mlp``."""
    m = _LAYER_RE.search(f".{prefix}.")
    if m is None:
        raise ValueError(f"{prefix!r} is not a module path inside a decoder layer")
    return int(m.group(1))


def _partial_matmul(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's product before its all-reduce (no bias: the shared experts have none)."""
    if isinstance(layer, QuantizedWeight):
        return layer.linear(x)
    return layer.matmul(x, with_bias=False)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a gated MLP of ``intermediate_size`` (column- then
    row-parallel) whose output is this rank's partial sum (the block scales it by
    ``sigmoid(shared_expert_gate(x))``)."""

    cpu_decoder_role = "silu_mlp"

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, quant: QuantConfig,
                 prefix: str):
        super().__init__()
        rows = OutputRows.split([intermediate_size, intermediate_size], [0, 1])
        self.intermediate_size = rows.sizes[0]
        self.gate_up_proj = quant.column_linear(f"{prefix}.gate_up_proj", hidden_size, rows, False, dtype)
        self.down_proj = quant.row_linear(f"{prefix}.down_proj", intermediate_size, hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``, before the all-reduce."""
        gate_up = self.gate_up_proj(x)
        h = gate_up.new_empty(gate_up.shape[0], self.intermediate_size)
        ops.silu_and_mul(h, gate_up)
        return _partial_matmul(self.down_proj, h)


class SparseMoeBlock(nn.Module):
    """``gate`` (the router, ``[num_experts, hidden]``), ``experts`` (``FusedMoE``) and, with a
    ``shared_intermediate_size``, ``shared_expert`` and ``shared_expert_gate``."""

    # The C++ layer loop runs the block (children: gate, experts; shared_expert, shared_expert_gate).
    cpu_decoder_role = "sparse_moe"

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 dtype: torch.dtype, quant: QuantConfig, prefix: str, shared_intermediate_size: int = 0):
        super().__init__()
        self.gate = Linear(hidden_size, num_experts, False, dtype)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize, dtype, quant,
                                f"{prefix}.experts")
        self.shared_expert: Optional[SharedExpert] = None
        if shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, shared_intermediate_size, dtype, quant,
                                              f"{prefix}.shared_expert")
            self.shared_expert_gate = Linear(hidden_size, 1, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, hidden]`` -> ``[num_tokens, hidden]``."""
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            ops.sigmoid_gated_add_(out, self.shared_expert(x), self.shared_expert_gate(x))
        return all_reduce(out) if tp_size() > 1 else out


def qwen_moe_mlp(hf_config: Any, dtype: torch.dtype, quant: QuantConfig, prefix: str,
                 shared: bool, dense_mlp: Any) -> nn.Module:
    """The MLP of a Qwen-MoE layer: the sparse block, or ``dense_mlp(hf_config, dtype, quant,
    prefix)`` for a layer in ``mlp_only_layers`` or off ``decoder_sparse_step``."""
    index = layer_index_of(prefix)
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    sparse = (index not in (getattr(hf_config, "mlp_only_layers", None) or []) and hf_config.num_experts > 0
              and (index + 1) % step == 0)
    if not sparse:
        return dense_mlp(hf_config, dtype, quant, prefix)
    return SparseMoeBlock(hf_config.hidden_size, hf_config.num_experts, hf_config.num_experts_per_tok,
                          hf_config.moe_intermediate_size, bool(getattr(hf_config, "norm_topk_prob", False)), dtype,
                          quant, prefix,
                          hf_config.shared_expert_intermediate_size if shared else 0)
