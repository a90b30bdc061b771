"""``LoRARequest``: which adapter a request runs under, by vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: ``lora_name`` (what a server lists and requests name), ``lora_int_id`` (a
    positive id unique per adapter: it keys the engine's adapter slots and the prefix cache) and
    ``lora_path``, a folder in PEFT's format (``adapter_config.json`` and
    ``adapter_model.safetensors``) or a ``.gguf`` LoRA file as llama.cpp writes them."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} has no lora_path")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
