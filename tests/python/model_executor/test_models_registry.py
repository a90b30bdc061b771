"""The model registry and architecture descriptions: Hugging Face and GGUF names resolve to the
same class, a config without ``architectures`` falls back on its model_type, checkpoint names
map onto fused parameters, and unknown names fail naming what is supported."""

from __future__ import annotations

import pytest
import torch

from vpage.model_executor import load_model
from vpage.model_executor.models import architecture_of, get_model_class, gguf_model_class, supported_architectures
from vpage.model_executor.models.llama import LlamaForCausalLM
from vpage.model_executor.models.qwen2 import Qwen2ForCausalLM


@pytest.mark.parametrize("names, cls", [(["LlamaForCausalLM", "MistralForCausalLM", "llama"], LlamaForCausalLM),
                                        (["Qwen2ForCausalLM", "qwen2"], Qwen2ForCausalLM)])
def test_hf_and_gguf_names_resolve_to_the_same_class(names, cls):
    assert all(get_model_class(name) is cls for name in names)
    assert gguf_model_class(names[-1]) is cls and cls.arch.gguf.name == names[-1]


def test_unknown_names_are_refused_naming_the_supported_ones():
    # Every family adds its names: the known ones are there, Hugging Face names sorted, then GGUF names.
    supported = supported_architectures()
    hf_names = [name for name in supported if name.endswith("ForCausalLM")]
    assert supported == sorted(hf_names) + sorted(set(supported) - set(hf_names))
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "llama", "qwen2"} <= set(supported)
    with pytest.raises(ValueError, match=r"unsupported model architecture 'GPT2LMHeadModel'; supported: "
                                         r"\[.*'LlamaForCausalLM', .*'qwen2'.*\]"):
        get_model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'phi2'; supported: \[.*'llama', .*'qwen2'.*\]"):
        gguf_model_class("phi2")


def test_model_type_fallback():
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    assert architecture_of(LlamaConfig(architectures=["MistralForCausalLM"])) == "MistralForCausalLM"
    assert [architecture_of(c()) for c in (LlamaConfig, MistralConfig, Qwen2Config)] == [
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]
    with pytest.raises(ValueError, match=r"unsupported model type 'gpt2'; supported: \[.*'llama', .*'mistral', .*'qwen2'.*\]"):
        architecture_of(GPT2Config())


def test_checkpoint_names_map_onto_parameters():
    arch = LlamaForCausalLM.arch
    layer = "model.layers.3"
    assert arch.param_for(f"{layer}.self_attn.k_proj.bias") == (f"{layer}.self_attn.qkv_proj.bias", "k")
    assert arch.param_for(f"{layer}.mlp.up_proj.weight") == (f"{layer}.mlp.gate_up_proj.weight", 1)
    assert arch.param_for(f"{layer}.self_attn.qkv_proj.weight") == (f"{layer}.self_attn.qkv_proj.weight", None)
    assert arch.param_for(f"{layer}.mlp.down_proj.weight") == (f"{layer}.mlp.down_proj.weight", None)
    assert arch.param_for(f"{layer}.self_attn.rotary_emb.inv_freq") is None


def test_unsupported_gguf_architecture_names_the_file(tmp_path):
    import gguf

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), arch="phi2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"phi.gguf: unsupported GGUF architecture 'phi2'; supported: \[.*'llama'"):
        load_model(str(path), device="cpu")
