"""The model registry: classes by Hugging Face architecture name and by GGUF architecture name.

Each class describes itself in ``arch`` (models/arch.py); adding a family is its model file
and one entry in ``_MODELS``.
"""

from __future__ import annotations

from typing import Any

from vpage.model_executor.models.gemma2 import Gemma2ForCausalLM
from vpage.model_executor.models.gemma3 import Gemma3ForCausalLM
from vpage.model_executor.models.llama import LlamaForCausalLM
from vpage.model_executor.models.mixtral import MixtralForCausalLM
from vpage.model_executor.models.phi3 import Phi3ForCausalLM
from vpage.model_executor.models.qwen2 import Qwen2ForCausalLM
from vpage.model_executor.models.qwen3 import Qwen3ForCausalLM
from vpage.model_executor.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

_MODELS: tuple[type[LlamaForCausalLM], ...] = (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM,
                                               Gemma2ForCausalLM, Gemma3ForCausalLM, MixtralForCausalLM,
                                               Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)

_BY_NAME = {name: cls for cls in _MODELS for name in cls.arch.architectures}
_BY_GGUF_NAME = {cls.arch.gguf.name: cls for cls in _MODELS
                 if cls.arch.gguf is not None and cls.arch.gguf.matches is None}
# Classes sharing another's GGUF architecture name, told apart by the file's metadata.
_GGUF_VARIANTS = tuple(cls for cls in _MODELS if cls.arch.gguf is not None and cls.arch.gguf.matches is not None)
_BY_MODEL_TYPE = {model_type: arch for cls in _MODELS for model_type, arch in cls.arch.model_types.items()}


def supported_architectures() -> list[str]:
    """Hugging Face architecture names, then GGUF architecture names, ``get_model_class`` accepts."""
    return sorted(_BY_NAME) + sorted(_BY_GGUF_NAME)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class for a Hugging Face (``LlamaForCausalLM``) or GGUF (``llama``) architecture
    name; ValueError naming the supported ones otherwise."""
    # A base model's name (Qwen3Model: how sentence-transformers saves an embedding model) is
    # its causal LM's class.
    cls = (_BY_NAME.get(architecture) or _BY_GGUF_NAME.get(architecture)
           or _BY_NAME.get(architecture.removesuffix("Model") + "ForCausalLM"))
    if cls is None:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {supported_architectures()}")
    return cls


def architecture_of(hf_config: Any) -> str:
    """The Hugging Face architecture name of a transformers config: its ``architectures``, or
    the one its ``model_type`` stands for; ValueError naming the supported model types."""
    archs = getattr(hf_config, "architectures", None)
    if archs:
        return archs[0]
    model_type = getattr(hf_config, "model_type", "")
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(f"unsupported model type {model_type!r}; supported: {sorted(_BY_MODEL_TYPE)}")
    return _BY_MODEL_TYPE[model_type]


def gguf_model_class(name: str, meta: Any = None) -> type[LlamaForCausalLM]:
    """The class of a GGUF file whose ``general.architecture`` is ``name`` (its description in
    ``arch.gguf``), a variant whose ``matches(meta)`` holds first (Mixtral among "llama" files);
    ValueError naming the supported GGUF architectures otherwise."""
    for variant in _GGUF_VARIANTS:
        if meta is not None and variant.arch.gguf.name == name and variant.arch.gguf.matches(meta):
            return variant
    cls = _BY_GGUF_NAME.get(name)
    if cls is None:
        raise ValueError(f"unsupported GGUF architecture {name!r}; supported: {sorted(_BY_GGUF_NAME)}")
    return cls
