"""Model classes by Hugging Face architecture name."""

from __future__ import annotations

from vpage.model_executor.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: the Llama structure with biases on the Q, K and V projections."""

    qkv_bias = True


_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def supported_architectures() -> list[str]:
    """Architecture names ``get_model_class`` accepts."""
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class for ``architecture``; ValueError naming the supported ones otherwise."""
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {supported_architectures()}"
        ) from None
