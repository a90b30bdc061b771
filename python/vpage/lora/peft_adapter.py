"""Reading a LoRA adapter in PEFT's format: ``adapter_config.json`` and
``adapter_model.safetensors`` (or ``adapter_model.bin``), as ``PeftModel.save_pretrained`` writes
them.

Each targeted linear layer ``W`` gains ``scaling * B @ A`` with A ``[r, in]`` (``lora_A``) and
B ``[out, r]`` (``lora_B``); ``scaling`` is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
rsLoRA), per module when ``rank_pattern`` / ``alpha_pattern`` override them. What vpage does not
serve (DoRA, biases, embedding or lm_head adapters, ``modules_to_save``) is refused by name.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

# lora_A / lora_B of a decoder layer's projection: (layer index, module name, "A" or "B").
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class PeftAdapter:
    """An adapter's matrices by (layer index, module name as the checkpoint names it: q_proj,
    gate_proj, ... or Phi-3's fused qkv_proj / gate_up_proj): (A ``[r, in]``, B ``[out, r]``
    times its scaling), float32."""

    path: str
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def max_rank(self) -> int:
        return max(a.shape[0] for a, _ in self.modules.values())


def _read_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"LoRA adapter {path!r}: no adapter_config.json (expected a PEFT adapter folder)")
    with open(config_path) as f:
        config = json.load(f)
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {path!r} is a {peft_type} adapter; vpage serves LORA adapters")
    refused = [(key, value) for key, value in (("use_dora", True), ("fan_in_fan_out", True)) if config.get(key)]
    if config.get("bias", "none") != "none":
        refused.append(("bias", config["bias"]))
    if config.get("modules_to_save"):
        refused.append(("modules_to_save", config["modules_to_save"]))
    if refused:
        raise ValueError(f"LoRA adapter {path!r} uses what vpage does not serve: "
                         + ", ".join(f"{k}={v!r}" for k, v in refused))
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    safetensors_path = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(safetensors_path):
        from safetensors.torch import load_file

        return load_file(safetensors_path)
    bin_path = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(bin_path):
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"LoRA adapter {path!r}: no adapter_model.safetensors or adapter_model.bin")


def _pattern_value(patterns: dict[str, Any], module_path: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module path that it ends
    (as a regular expression, after a dot or the start)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", module_path):
            return value
    return default


def load_peft_adapter(path: str) -> PeftAdapter:
    """The adapter in folder ``path``. FileNotFoundError for a missing folder or file;
    ValueError for an adapter vpage does not serve or whose A and B ranks disagree."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"LoRA adapter path {path!r} is not a folder")
    config = _read_config(path)
    tensors = _read_tensors(path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise ValueError(f"LoRA adapter {path!r} has a tensor vpage cannot apply: {key!r} (vpage serves "
                             "adapters on the decoder layers' attention and MLP projections)")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, module), {})[which] = tensor
    alpha, use_rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    modules = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = ({"A", "B"} - set(pair)).pop()
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {module} lacks its lora_{missing}")
        a, b = pair["A"].float(), pair["B"].float()
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank or rank == 0:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}, not [r, in] and [out, r]")
        module_path = f"model.layers.{layer}.{module}"
        module_alpha = float(_pattern_value(config.get("alpha_pattern"), module_path, alpha))
        scaling = module_alpha / (math.sqrt(rank) if use_rslora else rank)
        modules[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    if not modules:
        raise ValueError(f"LoRA adapter {path!r} has no lora_A / lora_B tensors")
    return PeftAdapter(path, modules)
