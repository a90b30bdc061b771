"""Shared fixtures: the default model as transformers loads it (loaded once per session)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a model hub


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls run far faster on one thread than on a loaded shared machine's two
    (modules opt in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hf_config():
    """transformers' own reading of the default model's GGUF metadata."""
    from transformers import AutoConfig

    from vpage.model_executor.loader.default_model import default_model_path

    path = default_model_path()
    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_model(hf_config):
    """transformers' Llama built from its own GGUF conversion (dequantize + un-permute), float32.

    ``from_pretrained(..., gguf_file=...)`` would do the same but requires ``accelerate``.
    """
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from vpage.model_executor.loader.default_model import default_model_path

    model = LlamaForCausalLM(hf_config).eval()
    tensors = load_gguf_checkpoint(str(default_model_path()), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    return model
