"""bench/make_gguf.py: its Q4_K blocks against gguf's own dequantizer, its tensor names and
shapes against gguf-py's mapping of transformers' models, and a shrunken file that vpage
loads with the logits transformers computes from the same file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from model_fixtures import PagedKVCache
from vpage.model_executor import load_model
from vpage.model_executor.loader.default_model import default_model_path

_SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "make_gguf.py"


@pytest.fixture(scope="module")
def mg():
    spec = importlib.util.spec_from_file_location("make_gguf", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_q4_k_blocks_dequantize_near_the_weights(mg):
    import gguf

    rng = np.random.default_rng(5)
    w = rng.standard_normal((7, 768)) * rng.uniform(0.005, 0.5, size=(7, 1))
    w[2, 40:300] += 0.3  # sub-blocks all positive: a zero min
    w[4, 256:512] = 0.0  # a block of zeros
    w = w.astype(np.float32)
    rows = mg.quantize_q4_k(w)
    assert rows.shape == (7, 3 * 144) and rows.dtype == np.uint8
    back = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.Q4_K)
    x = w.reshape(-1, 8, 32)
    step = (x.max(-1) - np.minimum(x.min(-1), 0))[..., None] / 15  # a sub-block's 4-bit step
    err = np.abs(back.reshape(x.shape) - x)
    assert (err <= 0.75 * step + 1e-7).all()
    assert np.abs(back[4, 256:512]).max() == 0


def _published_names(arch: str, hf_model) -> dict[str, tuple[int, ...]]:
    """GGUF name -> numpy shape of each tensor of ``hf_model``, through gguf-py's own map."""
    import gguf

    layers = hf_model.config.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    out = {}
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name != "lm_head.weight":  # tied
            out[names.get_name(hf_name, try_suffixes=(".weight",))] = tuple(tensor.shape)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_tensor_specs_match_transformers_models(mg, arch):
    import transformers

    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, intermediate_size=96, vocab_size=80, tie_word_embeddings=True)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    hf = model_class(config_class(**dims))
    shape = mg.Shape(arch, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=96,
                     context=128, rope_theta=1e4, rms_eps=1e-6)
    specs = mg.tensor_specs(shape, 2, 80)
    assert {s.name: s.shape for s in specs} == _published_names(arch, hf)
    permuted = {s.name: s.permute_heads for s in specs if s.permute_heads}
    assert permuted == ({"blk.0.attn_q.weight": 4, "blk.1.attn_q.weight": 4, "blk.0.attn_k.weight": 2,
                         "blk.1.attn_k.weight": 2} if arch == "llama" else {})


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "F32"])
def test_header_sizes_match_the_bytes_written(mg, qtype):
    spec = mg.TensorSpec("blk.0.ffn_up.weight", (3, 512))
    written = sum(chunk.nbytes for chunk in mg._chunks(spec, qtype, seed=1))
    assert written == mg._nbytes(spec, qtype)


def test_stored_types(mg):
    gemma = mg.tensor_specs(mg.SHAPES["gemma3-1b"], 1, 49152)
    types = {s.name: mg.stored_type(s, "Q4_K") for s in gemma}
    # Rows of 1152 (hidden) values are not whole 256-blocks: Q4_1; rows of 1024 or 6912 are.
    assert types["token_embd.weight"] == types["blk.0.attn_q.weight"] == "Q4_1"
    assert types["blk.0.ffn_up.weight"] == "Q4_1"
    assert types["blk.0.attn_output.weight"] == types["blk.0.ffn_down.weight"] == "Q4_K"
    assert types["blk.0.attn_k_norm.weight"] == types["blk.0.post_ffw_norm.weight"] == "F32"
    qwen = mg.tensor_specs(mg.SHAPES["qwen3-0.6b"], 1, 49152)
    assert {mg.stored_type(s, "Q4_K") for s in qwen if not s.is_norm} == {"Q4_K"}
    assert {mg.stored_type(s, "Q8_0") for s in qwen if s.is_norm} == {"F32"}


def test_shrunken_file_loads_with_transformers_logits(mg, tmp_path):
    """F32, so that vpage's decode path (8-bit activations for Q4_1 and Q8_0) cannot hide a
    wrong Q/K order or metadata value behind quantization noise."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, written = mg.make_gguf("smollm2-360m", "F32", tmp_path, layers=2)
    assert written and path.name == "smollm2-360m-L2-F32.gguf"
    loaded = load_model(str(path), device="cpu")
    assert loaded.config.num_layers == 2 and loaded.config.head_size == 64
    # The default model's tokenizer: its ids and its chat template.
    tokens = loaded.tokenizer.encode("The capital of France is", add_special_tokens=False)
    assert tokens == [504, 3575, 282, 4649, 314]
    chat = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert chat.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    cache = PagedKVCache(loaded.config)
    logits = loaded.model.compute_logits(loaded.model(cache.step({0: tokens}), cache.caches))

    # transformers' own GGUF reading (metadata, dequantization, Q/K un-permutation) into a
    # model shaped like vpage's: the config values it reads must be the published ones.
    hf = LlamaForCausalLM(loaded.hf_config).eval()
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)
    expected = dict(hidden_size=960, num_hidden_layers=2, num_attention_heads=15, num_key_value_heads=5,
                    intermediate_size=2560, vocab_size=49152, max_position_embeddings=8192,
                    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    assert {k: parsed["config"][k] for k in expected} == expected
    assert parsed["config"]["rms_norm_eps"] == pytest.approx(1e-5)
    assert len(parsed["tokenizer"]["tokens"]) == 49152
    # Q/K rows as llama.cpp permutes them: transformers' un-permutation gives back the rows in
    # the order they were drawn (the same tensor's rows written unpermuted).
    for name, part, rows in (("blk.1.attn_q.weight", "q_proj", 960), ("blk.1.attn_k.weight", "k_proj", 320)):
        drawn = next(mg._chunks(mg.TensorSpec(name, (rows, 960)), "F32", seed=0))
        assert np.array_equal(np.asarray(parsed["tensors"][f"model.layers.1.self_attn.{part}.weight"]), drawn)
    missing, unexpected = hf.load_state_dict(parsed["tensors"], strict=False)  # shapes checked here
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    hf.tie_weights()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert ref.std() > 0.1  # activations neither vanish nor blow up
    torch.testing.assert_close(logits, ref, atol=1e-4 * ref.abs().max().item(), rtol=0)

    mtime = path.stat().st_mtime_ns
    assert mg._existing_settings(default_model_path()) is None and mg._existing_settings(_SCRIPT) is None
    assert mg.make_gguf("smollm2-360m", "F32", tmp_path, layers=2) == (path, False)
    assert path.stat().st_mtime_ns == mtime


def test_moe_file_loads_with_its_experts_in_blocks(mg, tmp_path, monkeypatch):
    """A shrunken qwen3moe shape: llama.cpp's expert tensors and keys, read by vpage as a
    Qwen3-MoE whose expert stacks stay Q8_0 (routers F32)."""
    shape = mg.Shape("qwen3moe", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=96,
                     context=128, rope_theta=1e6, rms_eps=1e-6, experts=8, experts_used=2, expert_intermediate=64)
    monkeypatch.setitem(mg.SHAPES, "tiny-moe", shape)
    specs = {s.name: s for s in mg.tensor_specs(shape, 2, 80)}
    assert specs["blk.1.ffn_gate_exps.weight"].shape == (8, 64, 64) and "blk.0.ffn_gate.weight" not in specs
    assert mg.stored_type(specs["blk.0.ffn_gate_inp.weight"], "Q8_0") == "F32"
    path, _ = mg.make_gguf("tiny-moe", "Q8_0", tmp_path)
    loaded = load_model(str(path), device="cpu")
    cfg = loaded.hf_config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 2, 64, True)
    experts = loaded.model.model.layers[1].mlp.experts
    assert {s.qtype for s in (experts.w1, experts.w3, experts.w2)} == {"Q8_0"}
    cache = PagedKVCache(loaded.config)
    logits = loaded.model.compute_logits(loaded.model(cache.step({0: [5, 6, 7, 8]}), cache.caches))
    assert logits.shape == (4, 49152) and torch.isfinite(logits).all()
