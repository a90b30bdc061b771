"""A worker's adapters: loaded ones in an LRU of ``max_cpu_loras``, and ``max_loras`` slots that
the adapters of a step occupy.

The scheduler never puts more than ``max_loras`` distinct adapters into the running requests
(``SchedulerConfig.max_loras``), so a step's adapters always find slots. An adapter evicted from
the LRU is read from its files again when a step needs it (the manager keeps each adapter's
``LoRARequest``), so a request never fails because its adapter was evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from vpage.config import LoRAConfig
from vpage.lora.layers import SLICE_MODULES, ProjectionLora, attach_hooks, lora_targets, project_adapter
from vpage.lora.gguf_adapter import is_gguf_adapter, load_gguf_adapter
from vpage.lora.peft_adapter import load_peft_adapter
from vpage.lora.request import LoRARequest
from vpage.model_executor.layers.quant_linear import QuantizedWeight


class LoadedAdapter:
    """An adapter as one rank applies it: per target (``LoRAManager.targets`` order) its
    weights, or None for a projection it leaves alone."""

    def __init__(self, request: LoRARequest, projections: list[Optional[ProjectionLora]]):
        self.request = request
        self.projections = projections


class LoRAManager:
    """Loads adapters (PEFT folders, or llama.cpp's GGUF LoRA files) for ``model`` (packed
    weights already in place; ``hf_config`` its transformers config) and maps each step's rows
    to slots."""

    def __init__(self, model: nn.Module, hf_config: Any, config: LoRAConfig, activation_dtype: torch.dtype,
                 device: torch.device):
        self.config = config
        self.hf_config = hf_config
        arch = getattr(type(model), "arch", None)
        self.gguf_arch = arch.gguf if arch is not None else None  # GGUF adapters' tensor names
        self.device = device
        self.targets = lora_targets(model)
        if not self.targets:
            raise ValueError(f"{type(model).__name__} has no projections LoRA adapters attach to")
        self.dtype = _lora_dtype(config.lora_dtype, self.targets, activation_dtype, device)
        self.num_layers = len(model.model.layers)
        self.state, self.hooks = attach_hooks(self.targets, config.max_loras, self.dtype)
        self.requests: dict[int, LoRARequest] = {}  # every adapter added and not removed
        self.loaded: OrderedDict[int, LoadedAdapter] = OrderedDict()  # least recently used first
        self.slots: list[Optional[int]] = [None] * config.max_loras

    # ------------------------------------------------------------------ adapters

    def add_adapter(self, request: LoRARequest) -> bool:
        """Loads ``request``'s adapter (unless loaded); True when it was read now. Raises
        FileNotFoundError or ValueError (nothing changed) for an adapter that cannot serve this
        model: missing files, a rank above max_lora_rank, shapes of another base model."""
        adapter_id = request.lora_int_id
        known = self.requests.get(adapter_id)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(f"lora_int_id {adapter_id} is adapter {known.lora_name!r} ({known.lora_path}); "
                             f"{request.lora_name!r} needs an id of its own")
        if adapter_id in self.loaded:
            self.loaded.move_to_end(adapter_id)
            return False
        loaded = self._read(request)
        self.requests[adapter_id] = request
        self._insert(adapter_id, loaded, keep=())
        return True

    def remove_adapter(self, adapter_id: int) -> bool:
        """Forgets an adapter (its slot and loaded weights too); False when unknown."""
        if self.requests.pop(adapter_id, None) is None:
            return False
        self.loaded.pop(adapter_id, None)
        for slot, held in enumerate(self.slots):
            if held == adapter_id:
                self._clear_slot(slot)
        return True

    def list_adapters(self) -> list[int]:
        return sorted(self.requests)

    def _read(self, request: LoRARequest) -> LoadedAdapter:
        path = request.lora_path
        adapter = (load_gguf_adapter(path, self.gguf_arch, self.hf_config) if is_gguf_adapter(path)
                   else load_peft_adapter(path))
        if adapter.max_rank > self.config.max_lora_rank:
            raise ValueError(f"LoRA adapter {request.lora_name!r} has rank {adapter.max_rank}, above max_lora_rank "
                             f"{self.config.max_lora_rank}")
        used = set()
        projections = []
        try:
            for target in self.targets:
                projections.append(project_adapter(adapter, target, self.dtype, self.device))
                used.update((target.layer, name) for name in _module_names(target.name))
        except ValueError as e:
            raise ValueError(f"LoRA adapter {request.lora_name!r} does not fit the base model: {e}") from e
        unknown = sorted(set(adapter.modules) - used)
        if unknown:
            layer, module = unknown[0]
            raise ValueError(f"LoRA adapter {request.lora_name!r} targets layer {layer} {module}, which this model "
                             f"({self.num_layers} layers) has no adapter slot for")
        return LoadedAdapter(request, projections)

    def _insert(self, adapter_id: int, loaded: LoadedAdapter, keep) -> None:
        self.loaded[adapter_id] = loaded
        for held in list(self.loaded):
            if len(self.loaded) <= self.config.max_cpu_loras:
                break
            if held != adapter_id and held not in keep:
                del self.loaded[held]
                for slot, in_slot in enumerate(self.slots):
                    if in_slot == held:
                        self._clear_slot(slot)

    # ---------------------------------------------------------------------- steps

    def prepare_step(self, lora_ids: np.ndarray, query_start_loc: np.ndarray) -> Optional[torch.Tensor]:
        """The slot of each token of a step whose rows run under ``lora_ids`` (int32 ``[num_seqs]``,
        0 for the base model; rows as ``query_start_loc`` cuts the tokens), int32 on the model's
        device, or None when no row has an adapter. Loads evicted adapters back and fills the
        slots; the hooks read the result (``LoraState``)."""
        used = np.unique(lora_ids[lora_ids > 0]).tolist() if len(lora_ids) else []
        if not used:
            self.state.token_slots = None
            return None
        if len(used) > len(self.slots):
            raise RuntimeError(f"a step with {len(used)} LoRA adapters, above max_loras {len(self.slots)}")
        for adapter_id in used:
            if adapter_id in self.loaded:
                self.loaded.move_to_end(adapter_id)
                continue
            request = self.requests.get(adapter_id)
            if request is None:
                raise RuntimeError(f"a step runs LoRA adapter {adapter_id}, which was never added")
            self._insert(adapter_id, self._read(request), keep=used)
        slot_of = {adapter_id: slot for slot, adapter_id in enumerate(self.slots) if adapter_id in used}
        free = [slot for slot, adapter_id in enumerate(self.slots) if adapter_id not in slot_of]
        for adapter_id in used:
            if adapter_id not in slot_of:
                slot = free.pop(0)
                self._fill_slot(slot, adapter_id)
                slot_of[adapter_id] = slot
        row_slots = np.array([slot_of.get(i, -1) for i in lora_ids.tolist()], dtype=np.int32)
        token_slots = torch.from_numpy(np.repeat(row_slots, np.diff(query_start_loc)))
        self.state.token_slots = token_slots.to(self.device)
        return self.state.token_slots

    def _fill_slot(self, slot: int, adapter_id: int) -> None:
        loaded = self.loaded[adapter_id]
        for hook, weights in zip(self.hooks, loaded.projections):
            hook.set_slot(slot, weights)
        self.slots[slot] = adapter_id

    def _clear_slot(self, slot: int) -> None:
        for hook in self.hooks:
            hook.set_slot(slot, None)
        self.slots[slot] = None


def _module_names(projection: str) -> tuple[str, ...]:
    """Checkpoint module names that land on ``projection`` (Phi-3's fused names included)."""
    names = SLICE_MODULES[projection]
    return names if len(names) == 1 else (*names, projection)


def _lora_dtype(name: str, targets: list, activation_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The adapters' dtype: ``name``, or for "auto" the activations' dtype, but bfloat16 beside
    quantized weights on the CPU. A decode step reads each adapter's A and B from memory once
    per token, which beside a 4-bit base adds a quarter to the bytes of a float32 step: in
    bfloat16 half of that (the adapter's rounding is small against the base's quantization)."""
    if name != "auto":
        return getattr(torch, name)
    quantized = any(isinstance(t.module, QuantizedWeight) for t in targets)
    if quantized and device.type == "cpu" and activation_dtype == torch.float32:
        return torch.bfloat16
    return activation_dtype
