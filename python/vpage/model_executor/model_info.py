"""What the engine needs to know about a model before loading it: read from its config
(config.json or GGUF metadata), never its weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vpage.model_executor.layers.parallel_linear import check_head_split
from vpage.model_executor.loader.model_loader import _max_model_len, load_hf_config
from vpage.model_executor.models.llama import num_kv_heads_of


@dataclass(frozen=True)
class ModelFacts:
    hf_config: Any  # the transformers config
    num_attention_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_model_len: int  # the longest context the model supports

    def check_tensor_parallel(self, size: int) -> None:
        """ValueError unless ``size`` ranks can split the heads and the MLP."""
        check_head_split(self.num_attention_heads, self.num_kv_heads, size)
        if self.intermediate_size % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the intermediate size "
                             f"{self.intermediate_size}")


def inspect_model(model: str | None) -> ModelFacts:
    """The facts of ``model`` (as ``load_model`` resolves it); the loader's errors otherwise."""
    hf = load_hf_config(model)
    return ModelFacts(hf, hf.num_attention_heads, num_kv_heads_of(hf), hf.intermediate_size, _max_model_len(hf))


def resolve_device(device: str) -> torch.device:
    """"auto" is CUDA when a device is usable, else the CPU; ValueError for anything else
    than auto/cpu/cuda, or cuda without a device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return torch.device(device)
