"""What the engine needs to know about a model before loading it: read from its config
(config.json or GGUF metadata), never its weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from vpage.model_executor.layer_types import uniform_sliding_window
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
    # The sliding window every attention layer shares (None: none, or windowed and global
    # layers mixed); the block manager may free the KV blocks before it.
    sliding_window: Optional[int] = None
    # A mixture of experts: (config field, size) of its experts' and shared expert's
    # intermediate dimensions, which tensor parallelism splits too.
    expert_intermediate_sizes: tuple[tuple[str, int], ...] = ()

    def check_tensor_parallel(self, size: int) -> None:
        """ValueError unless ``size`` ranks can split the heads, the MLP and the experts."""
        check_head_split(self.num_attention_heads, self.num_kv_heads, size)
        if self.intermediate_size % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the intermediate size "
                             f"{self.intermediate_size}")
        for name, value in self.expert_intermediate_sizes:
            if value % size:
                raise ValueError(f"tensor_parallel_size {size} does not divide the experts' {name} {value}")


def inspect_model(model: str | None) -> ModelFacts:
    """The facts of ``model`` (as ``load_model`` resolves it); the loader's errors otherwise."""
    hf = load_hf_config(model)
    experts = tuple((name, int(getattr(hf, name))) for name in ("moe_intermediate_size",
                                                                "shared_expert_intermediate_size")
                    if getattr(hf, name, None))
    return ModelFacts(hf, hf.num_attention_heads, num_kv_heads_of(hf), hf.intermediate_size, _max_model_len(hf),
                      uniform_sliding_window(hf), experts)
