"""Phi-3 family on tiny random models: pre-fused qkv_proj / gate_up_proj loaded as stored,
longrope whose sequences cross the original length (32) in prefills, chunks and decode steps,
Phi-4-mini-like partial rotary (3/4 of each head) with tied embeddings, a Phi-3-mini-4k-like
sliding window; logits against transformers from the folder and from a GGUF file written like
llama.cpp's converter (attn_qkv, ffn_up holding gate+up, rope_factors_long/short,
rope.dimension_count, a Q8_0 file keeping the fused projections quantized); engine greedy
parity through family_parity."""

from __future__ import annotations

import copy
import inspect

import numpy as np
import pytest
import torch

from chunked_reference import assert_chunks_match, vpage_logits_per_chunk
from family_parity import ENGINE_SETTINGS, assert_family_parity, engine_greedy, hf_greedy, setting_params
from model_fixtures import _TINY, save_tiny_gguf, save_tiny_tokenizer
from vpage import ops
from vpage.model_executor import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ORIGINAL = 32
_window_kernels = pytest.mark.skipif("sliding_window" not in inspect.signature(ops.paged_attention).parameters,
                                     reason="paged attention has no sliding_window yet")
_partial_kernel = pytest.mark.skipif("rotary_dim" not in inspect.signature(ops.rotary_embedding).parameters,
                                     reason="ops.rotary_embedding has no rotary_dim (partial rotary) yet")


def _longrope(pairs: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"rope_type": "longrope", "short_factor": (1 + rng.random(pairs)).tolist(),
            "long_factor": (1 + 6 * rng.random(pairs)).tolist()}


# head 16: Phi-3.5-mini-like (longrope over the whole head), Phi-4-mini-like (3/4 of it, tied
# embeddings, a window longer than any context, left off), Phi-3-mini-4k-like (plain rope, a
# sliding window of 16).
CASES = {
    "phi3.5": dict(rope_parameters=_longrope(8, 1)),
    "phi4-mini": dict(rope_parameters={**_longrope(6, 2), "partial_rotary_factor": 0.75}, tie_word_embeddings=True,
                      sliding_window=4096),
    "phi3-4k window": dict(rope_parameters={"rope_type": "default"}, sliding_window=16),
}
_MARKS = {"phi4-mini": [_partial_kernel], "phi3-4k window": [_window_kernels]}
# Two sequences: 0 starts below the original length and crosses it in a chunk, then decodes;
# 1 starts past it.
_STEPS = [{0: 20, 1: 40}, {0: 10, 1: 1}, {0: 1, 1: 1}, {0: 5, 1: 1}, {0: 1, 1: 7}, {0: 1, 1: 1}]


def save_tiny_phi3(folder, seed: int = 0, **overrides):
    """A random tiny Phi3ForCausalLM (float32) and tokenizer saved into ``folder``; returned."""
    from transformers import AutoModelForCausalLM, Phi3Config

    rope = {"rope_theta": 500.0, **overrides.pop("rope_parameters", {})}
    cfg = Phi3Config(**{**_TINY, "max_position_embeddings": 128, "original_max_position_embeddings": ORIGINAL,
                        "pad_token_id": None, "rope_parameters": rope, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(str(folder))
    save_tiny_tokenizer(folder)
    return model


def _case_params():
    return [pytest.param(name, marks=_MARKS.get(name, [])) for name in CASES]


@pytest.fixture(scope="module", params=_case_params())
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param.replace(" ", "_"))
    return request.param, folder, save_tiny_phi3(folder, seed=3, **CASES[request.param])


def test_folder_matches_transformers(tiny):
    name, folder, hf = tiny
    loaded = load_model(str(folder), device="cpu")
    assert loaded.config.architecture == "Phi3ForCausalLM"
    assert loaded.model.tie_word_embeddings == (name == "phi4-mini")
    rotary = loaded.model.model.rotary_emb
    assert (rotary.rotary_dim, rotary.kind) == {"phi3.5": (16, "longrope"), "phi4-mini": (12, "longrope"),
                                                "phi3-4k window": (16, "default")}[name]
    windows = {layer.self_attn.attn.sliding_window for layer in loaded.model.model.layers}
    assert windows == ({16} if name == "phi3-4k window" else {None})
    # The checkpoint's fused tensors load as they are.
    state = hf.state_dict()
    params = dict(loaded.model.named_parameters())
    for hf_name in ("model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"):
        assert torch.equal(params[hf_name], state[hf_name])
    assert_chunks_match(loaded, hf, _STEPS)


def test_gguf_matches_transformers(tiny, tmp_path):
    name, folder, hf = tiny
    path = tmp_path / "phi3.gguf"
    save_tiny_gguf(hf, folder, path)
    loaded = load_model(str(path), device="cpu")
    cfg = loaded.hf_config
    assert loaded.config.architecture == "Phi3ForCausalLM" and loaded.model.tie_word_embeddings == (name == "phi4-mini")
    assert cfg.sliding_window == hf.config.sliding_window
    assert cfg.rope_parameters["partial_rotary_factor"] == hf.config.rope_parameters["partial_rotary_factor"]
    if name != "phi3-4k window":
        for key in ("short_factor", "long_factor"):
            np.testing.assert_allclose(cfg.rope_parameters[key], hf.config.rope_parameters[key], rtol=1e-7)
        assert cfg.rope_parameters["original_max_position_embeddings"] == ORIGINAL
    assert_chunks_match(loaded, hf, _STEPS)


def test_quantized_gguf_keeps_the_fused_projections_quantized(tiny, tmp_path):
    """Q8_0 rows of attn_qkv / ffn_up load as one quantized layer each; the logits stay
    close to the float GGUF's (Q8_0 rounding only)."""
    import gguf

    from quant_fixtures import quantized_rows
    from vpage.model_executor.layers.quant_linear import QuantizedLinear

    name, folder, hf = tiny
    rng = np.random.default_rng(0)
    path = tmp_path / "phi3-q8.gguf"
    save_tiny_gguf(hf, folder, path, lambda n, w: (quantized_rows("Q8_0", w, rng), gguf.GGMLQuantizationType.Q8_0)
                   if w.ndim == 2 and "embed" not in n and "lm_head" not in n else None)
    quantized = load_model(str(path), device="cpu")
    dequantized = load_model(str(path), device="cpu", quantization="none")
    layer = quantized.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear) and isinstance(layer.mlp.gate_up_proj,
                                                                                QuantizedLinear)
    tokens = {0: list(range(3, 43))}
    got = vpage_logits_per_chunk(quantized, tokens, [{0: 40}])[0][0]
    ref = vpage_logits_per_chunk(dequantized, tokens, [{0: 40}])[0][0]
    assert ref.abs().max() > 0.01
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0)


@pytest.fixture(scope="module")
def longrope_phi4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("phi4_engine")
    return folder, save_tiny_phi3(folder, seed=11, **CASES["phi4-mini"])


@_partial_kernel
@pytest.mark.parametrize("setting", setting_params(["plain", "tp2"]))
def test_engine_longrope_matches_transformers(longrope_phi4, setting):
    """Prompts of 24 whose generations cross the original 32 and a second turn (67 tokens)
    whose whole prefill is past it (long factors for all of it, as transformers has them)."""
    folder, hf = longrope_phi4
    assert_family_parity(folder, hf, [setting], prompt_len=24)


@_partial_kernel
def test_engine_longrope_chunked_prompts_below_the_original_length(longrope_phi4):
    """Chunked prompts that end at or below the original length; decode steps cross it."""
    folder, hf = longrope_phi4
    prompts = [list(range(3, 27)), list(range(100, 130)), list(range(200, 229))]
    expected = [hf_greedy(copy.deepcopy(hf), p, 32) for p in prompts]
    assert engine_greedy(folder, prompts, 32, **ENGINE_SETTINGS["chunked"]) == expected


@_window_kernels
@pytest.mark.parametrize("setting", setting_params(["plain", "chunked", "prefix", "preempt"]))
def test_engine_sliding_window_matches_transformers(tmp_path_factory, setting):
    folder = tmp_path_factory.mktemp("phi3_window")
    hf = save_tiny_phi3(folder, seed=12, **CASES["phi3-4k window"])
    assert_family_parity(folder, hf, [setting], prompt_len=37)
