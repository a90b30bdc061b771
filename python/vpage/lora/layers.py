"""Where adapters attach to a vpage model, and how one projection adds each row's adapter.

Adapters attach to the four projections of a decoder layer: the fused ``qkv_proj`` (slices q,
k, v), ``o_proj``, the fused ``gate_up_proj`` (slices gate, up) and ``down_proj``. For a
projection, an adapter is one A ``[num_slices * rank, in]`` (slice j's A in rows ``[j rank,
(j + 1) rank)``, zeros for a slice it leaves alone) and per targeted slice a B ``[slice rows,
rank]`` with its scaling folded in: one shrink serves every slice (Punica's fused SGMV over a
fused projection). Under tensor parallelism a rank keeps B's rows of its output slice on a
column-parallel projection, and A's columns of its input slice on a row-parallel one (whose
partial sums the projection's all-reduce adds up).

``LoraHook`` is set as ``module.lora`` on each projection; the layers call ``add_(x, y)`` after
their matmul (before a row-parallel all-reduce). Its slot table ``module.lora_table`` (int64
``[max_loras, 5]``: A, B per slice as pointers to weights packed for ``ops.dense_matmul``, and the
rank) is what ``ops.lora_add`` and the C++ layer loop read on the CPU. On CUDA the hook keeps a
device copy of the table (``device_table``: pointers to the plain ``a`` and ``b``) for
``_ops_cuda.lora_add``; other devices, and CUDA without vpage._cuda, multiply with torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from vpage import _ops_cuda, ops
from vpage.distributed.parallel_state import tp_rank, tp_size
from vpage.lora.peft_adapter import PeftAdapter
from vpage.model_executor.layers.linear import DenseWeight
from vpage.model_executor.layers.parallel_linear import RowPart
from vpage.model_executor.layers.quant_linear import QuantizedWeight

# A projection -> the checkpoint modules of its slices, in order.
SLICE_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                 "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
_TABLE_WIDTH = 5  # a, b0, b1, b2, rank (LoraAdapterWeights in kernels/lora.h)


@dataclass(frozen=True)
class LoraTarget:
    """One projection adapters attach to: its output slices on this rank (the checkpoint's parts)
    and its input columns on this rank."""

    layer: int
    name: str
    module: nn.Module
    parts: tuple[RowPart, ...]
    in_features: int

    @property
    def row_parallel(self) -> bool:
        return self.name in _ROW_PARALLEL

    @property
    def slice_rows(self) -> list[int]:
        return [part.rows for part in self.parts]


def lora_targets(model: nn.Module) -> list[LoraTarget]:
    """The projections of ``model``'s decoder layers (a mixture-of-experts MLP has none)."""
    targets = []
    for index, layer in enumerate(model.model.layers):
        for owner, names in ((getattr(layer, "self_attn", None), ("qkv_proj", "o_proj")),
                             (getattr(layer, "mlp", None), ("gate_up_proj", "down_proj"))):
            for name in names:
                module = getattr(owner, name, None)
                if not isinstance(module, (DenseWeight, QuantizedWeight)):
                    continue
                dense = isinstance(module, DenseWeight)
                if name in _ROW_PARALLEL:
                    out = module.weight_shape[0] if dense else module.rows
                    parts = (RowPart(None, out, 0, out),)
                else:
                    parts = (module.rows if dense else module.layout).parts
                in_features = module.weight_shape[1] if dense else module.cols
                targets.append(LoraTarget(index, name, module, tuple(parts), in_features))
    return targets


@dataclass
class ProjectionLora:
    """One adapter on one projection (this rank's share), in the LoRA dtype: ``a`` and ``b``
    as the module docstring lays them out, and on the CPU the same packed for the kernels."""

    a: Optional[torch.Tensor]  # None once packed (CPU)
    b: list[Optional[torch.Tensor]]
    rank: int
    packed_a: Optional[torch.Tensor] = None
    packed_b: Optional[list[Optional[torch.Tensor]]] = None

    def table_row(self) -> list[int]:
        b = [0 if t is None else t.data_ptr() for t in self.packed_b] + [0] * (3 - len(self.packed_b))
        return [self.packed_a.data_ptr(), *b, self.rank]

    def device_table_row(self) -> list[int]:
        """The table row of the plain ``a`` and ``b`` (off the CPU): their data pointers, the rank."""
        b = [0 if t is None else t.data_ptr() for t in self.b] + [0] * (3 - len(self.b))
        return [self.a.data_ptr(), *b, self.rank]


def _slice_pairs(adapter: PeftAdapter, target: LoraTarget) -> list[Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """(A, B) of each slice of ``target`` in ``adapter`` (None: slice left alone); a fused
    checkpoint module (Phi-3's qkv_proj, gate_up_proj) gives every slice its one A."""
    names = SLICE_MODULES[target.name]
    fused = adapter.modules.get((target.layer, target.name)) if len(names) > 1 else None
    if fused is None:
        return [adapter.modules.get((target.layer, name)) for name in names]
    a, b = fused
    totals = [part.total for part in target.parts]
    if b.shape[0] != sum(totals):
        raise ValueError(f"layer {target.layer} {target.name} lora_B has {b.shape[0]} rows, the base model "
                         f"{sum(totals)}")
    return [(a, piece) for piece in b.split(totals)]


def project_adapter(adapter: PeftAdapter, target: LoraTarget, dtype: torch.dtype,
                    device: torch.device) -> Optional[ProjectionLora]:
    """``adapter`` on ``target`` for this rank, or None when it leaves the projection alone.
    ValueError when its shapes do not fit the base model's."""
    pairs = _slice_pairs(adapter, target)
    present = [pair for pair in pairs if pair is not None]
    if not present:
        return None
    rank = max(a.shape[0] for a, _ in present)
    size, rank_index = tp_size(), tp_rank()
    full_in = target.in_features * size if target.row_parallel else target.in_features
    a_rows, b_slices = [], []
    for pair, part, module in zip(pairs, target.parts, SLICE_MODULES[target.name]):
        if pair is None:
            a_rows.append(torch.zeros(rank, target.in_features))
            b_slices.append(None)
            continue
        a, b = pair
        if a.shape[1] != full_in or b.shape[0] != part.total:
            raise ValueError(f"layer {target.layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                             f"not fit the base model's [{part.total}, {full_in}] projection")
        if target.row_parallel:
            a = a.narrow(1, rank_index * target.in_features, target.in_features)
        b = b.narrow(0, part.start, part.rows)
        pad = rank - a.shape[0]  # a smaller rank on this slice (rank_pattern): zero rows and columns
        a_rows.append(torch.cat([a, a.new_zeros(pad, a.shape[1])]) if pad else a)
        b_slices.append((torch.cat([b, b.new_zeros(b.shape[0], pad)], dim=1) if pad else b).to(dtype).contiguous())
    a = torch.cat(a_rows).to(dtype).contiguous()
    if device.type == "cpu":
        return ProjectionLora(None, [None] * len(b_slices), rank, ops.pack_dense_weight(a),
                              [None if b is None else ops.pack_dense_weight(b) for b in b_slices])
    return ProjectionLora(a.to(device), [None if b is None else b.to(device) for b in b_slices], rank)


class LoraState:
    """What every hook of a model reads in a step: the slot of each token (int32 ``[num_tokens]``,
    -1 for the base model), or None when no row of the step has an adapter."""

    def __init__(self) -> None:
        self.token_slots: Optional[torch.Tensor] = None


class LoraHook:
    """A projection's adapter slots; ``add_(x, y)`` adds to output rows ``y`` their tokens'
    adapters applied to input rows ``x``."""

    def __init__(self, state: LoraState, target: LoraTarget, max_loras: int, dtype: torch.dtype):
        self.state = state
        self.target = target
        self.dtype = dtype
        self.slots: list[Optional[ProjectionLora]] = [None] * max_loras
        self.table = torch.zeros(max_loras, _TABLE_WIDTH, dtype=torch.int64)
        # On CUDA: the table of the plain weights on their device (made by the first slot set
        # there), and the largest rank of the slots (sizes the kernel's workspace).
        self.device_table: Optional[torch.Tensor] = None
        self.max_rank = 0

    def set_slot(self, slot: int, weights: Optional[ProjectionLora]) -> None:
        self.slots[slot] = weights
        row = [0] * _TABLE_WIDTH if weights is None or weights.packed_a is None else weights.table_row()
        self.table[slot] = torch.tensor(row, dtype=torch.int64)
        device = weights.a.device if weights is not None and weights.a is not None else None
        if device is not None and device.type == "cuda" and (self.device_table is None
                                                             or self.device_table.device != device):
            rows = [_device_row(w, device) for w in self.slots]
            self.device_table = torch.tensor(rows, dtype=torch.int64).to(device)
        elif self.device_table is not None:  # copied on the current stream, before the next step's kernels
            self.device_table[slot] = torch.tensor(_device_row(weights, self.device_table.device), dtype=torch.int64)
        self.max_rank = max((w.rank for w in self.slots if w is not None and w.a is not None), default=0)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        token_slots = self.state.token_slots
        if token_slots is None:
            return
        if y.device.type == "cpu":
            ops.lora_add(y, x, token_slots, self.table, self.target.slice_rows, self.dtype)
            return
        if (self.device_table is not None and _ops_cuda.HAS_KERNELS and y.device == self.device_table.device
                and x.dtype == y.dtype and x.stride(-1) == 1 and y.stride(-1) == 1):
            _ops_cuda.lora_add(y, x, token_slots, self.device_table, self.target.slice_rows, self.max_rank, self.dtype)
            return
        offsets = [0]
        for rows in self.target.slice_rows:
            offsets.append(offsets[-1] + rows)
        for slot, weights in enumerate(self.slots):
            if weights is None:
                continue
            index = (token_slots == slot).nonzero().squeeze(1)
            if index.numel() == 0:
                continue
            shrunk = x.index_select(0, index).to(self.dtype) @ weights.a.T
            for j, b in enumerate(weights.b):
                if b is not None:
                    delta = shrunk[:, j * weights.rank:(j + 1) * weights.rank] @ b.T
                    y[:, offsets[j]:offsets[j + 1]].index_add_(0, index, delta.to(y.dtype))


def _device_row(weights: Optional[ProjectionLora], device: torch.device) -> list[int]:
    """``weights``' row of a hook's device table on ``device`` (zeros: none there)."""
    if weights is None or weights.a is None or weights.a.device != device:
        return [0] * _TABLE_WIDTH
    return weights.device_table_row()


def attach_hooks(targets: list[LoraTarget], max_loras: int, dtype: torch.dtype) -> tuple[LoraState, list[LoraHook]]:
    """Hooks on every target (``module.lora``; on the CPU also ``module.lora_table`` and
    ``module.lora_dtype`` for the C++ layer loop), sharing one state."""
    state = LoraState()
    hooks = []
    for target in targets:
        hook = LoraHook(state, target, max_loras, dtype)
        module: Any = target.module
        module.lora = hook
        module.lora_table = hook.table
        module.lora_dtype = dtype
        hooks.append(hook)
    return state, hooks
