"""Multi-LoRA serving: adapters in PEFT's format over the base model's projections, many in one
batch (``LoRARequest`` per request; ``EngineArgs(enable_lora=True)``)."""

from vpage.lora.request import LoRARequest

__all__ = ["LoRARequest"]
