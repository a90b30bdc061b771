"""The small, architecture-neutral description of a loaded model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ModelConfig:
    """What the engine needs to know about a model to size and drive the KV cache."""

    architecture: str  # e.g. "LlamaForCausalLM"
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    max_model_len: int  # longest context the model supports
    dtype: torch.dtype  # dtype of weights and activations (and of the KV cache by default)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    kv_cache_dtype: torch.dtype | None = None  # None: dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        """dtype of the KV cache."""
        return self.kv_cache_dtype or self.dtype

    def cache_block_bytes(self, block_size: int) -> int:
        """Bytes one KV cache block takes over all layers (keys and values)."""
        element = torch.empty((), dtype=self.cache_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * block_size * element
