"""The experts of a mixture-of-experts block, run by one kernel (``ops.fused_moe``).

``FusedMoE`` holds three expert stacks: ``w1`` (gate) and ``w3`` (up), ``[experts,
intermediate, hidden]``, and ``w2`` (down), ``[experts, hidden, intermediate]``, each either
float (packed once for the CPU kernel, like ``DenseWeight``) or raw GGUF block rows (uint8
``qweight``), as the ``QuantConfig`` decides. Under tensor parallelism every rank holds all
experts with its slice of the intermediate dimension (rows of w1 and w3, columns of w2), so its
output is a partial sum: the block that owns the experts all-reduces once.

Checkpoints load per expert (``experts.{e}.gate_proj`` and the like: shard id ``e``) or as
whole stacks (GGUF's ``ffn_gate_exps``: shard None). A whole stack of block rows on one rank is
kept as the loader gave it (for GGUF, a view of the memory-mapped file), not copied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from vpage import ops
from vpage.distributed.parallel_state import tp_rank, tp_size
from vpage.model_executor.layers.weight_utils import (QuantizedTensor, ShardId, copy_checked, empty_parameter,
                                                      float_tensor, set_weight_loader)

if TYPE_CHECKING:
    from vpage.model_executor.layers.quantization import QuantConfig


class ExpertStack(nn.Module):
    """``num_experts`` matrices of ``rows x cols`` (this rank's), cut from checkpoint matrices
    along ``split_dim`` (0: rows, 1: columns) at this rank's share. Float: ``weight`` until
    packed (``pack``), then ``packed``; quantized: ``qweight`` of ``qtype`` rows."""

    def __init__(self, num_experts: int, rows: int, cols: int, split_dim: int, dtype: torch.dtype,
                 qtype: Optional[str]):
        super().__init__()
        self.num_experts, self.rows, self.cols, self.split_dim, self.qtype = num_experts, rows, cols, split_dim, qtype
        self.size, self.rank = tp_size(), tp_rank()
        self.packed: Optional[torch.Tensor] = None
        if qtype is None:
            self.weight = empty_parameter(num_experts, rows, cols, dtype=dtype)
            param = self.weight
        else:
            self.type_id = ops.QUANT_TYPES[qtype][0]
            self.qweight = empty_parameter(num_experts, rows, ops.quant_row_bytes(qtype, cols), dtype=torch.uint8)
            param = self.qweight
        set_weight_loader(param, self.weight_loader, tuple(range(num_experts)))

    def _local(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of ``loaded`` along ``dim`` (rows or, for block rows, bytes)."""
        if self.size == 1:
            return loaded
        share = loaded.shape[dim] // self.size
        return loaded.narrow(dim, self.rank * share, share)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: ShardId) -> None:
        """Expert ``shard_id``'s checkpoint matrix, or (None) the whole stack."""
        if shard_id is not None and not 0 <= shard_id < self.num_experts:
            raise ValueError(f"is expert {shard_id} of a model with {self.num_experts} experts")
        dest = param.data if shard_id is None else param.data[shard_id]
        offset = 1 if shard_id is None else 0  # the matrix's first dimension in ``loaded``
        if self.qtype is None:
            copy_checked(dest, self._local(float_tensor(loaded), offset + self.split_dim))
            return
        if not isinstance(loaded, QuantizedTensor) or loaded.type_id != self.type_id:
            got = f"ggml type {loaded.type_id}" if isinstance(loaded, QuantizedTensor) else f"{loaded.dtype}"
            raise ValueError(f"({got}) does not match the quantized experts ({self.qtype})")
        local = self._local(loaded.data, offset + self.split_dim)  # whole blocks: checked at construction
        if shard_id is None and self.size == 1 and local.shape == dest.shape:
            param.data = local  # the loader's tensor (a GGUF file's mapping) as it is
            return
        copy_checked(dest, local)

    def pack(self) -> None:
        """Packs float experts for the CPU kernel and drops the unpacked ones."""
        if self.qtype is None and self.packed is None:
            self.packed = ops.pack_expert_weights(self.weight.data)
            self.weight = None

    def kernel_weights(self) -> torch.Tensor:
        """The stack as ``ops.fused_moe`` takes it: block rows, float experts packed on first use
        on the CPU, plain on CUDA."""
        if self.qtype is not None:
            return self.qweight
        if self.packed is None and self.weight.device.type == "cuda":
            return self.weight
        self.pack()
        return self.packed

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, rows={self.rows}, cols={self.cols}, qtype={self.qtype}"


class FusedMoE(nn.Module):
    """The experts of a block: ``forward(x, router_logits)`` routes each token to its ``top_k``
    experts (softmax, top-k, renormalised when ``renormalize``) and returns the weighted sum of
    their gated MLPs, this rank's partial sum under tensor parallelism."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 dtype: torch.dtype, quant: "QuantConfig", prefix: str):
        super().__init__()
        size = tp_size()
        if intermediate_size % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the experts' intermediate size "
                             f"{intermediate_size}")
        local = intermediate_size // size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.w1 = ExpertStack(num_experts, local, hidden_size, 0, dtype,
                              quant.expert_qtype(f"{prefix}.w1", hidden_size, False))
        self.w3 = ExpertStack(num_experts, local, hidden_size, 0, dtype,
                              quant.expert_qtype(f"{prefix}.w3", hidden_size, False))
        self.w2 = ExpertStack(num_experts, hidden_size, local, 1, dtype,
                              quant.expert_qtype(f"{prefix}.w2", intermediate_size, True))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x ``[num_tokens, hidden]``, router_logits ``[num_tokens, num_experts]`` -> ``[num_tokens, hidden]``."""
        stacks = (self.w1, self.w3, self.w2)
        return ops.fused_moe(x, *(s.kernel_weights() for s in stacks), router_logits.float(), self.top_k,
                             self.renormalize, qtypes=tuple(s.qtype for s in stacks))
