"""Tiny Llama (Q/K rows permuted by llama.cpp's converter) and Qwen2 models written as GGUF
with their matrices in every kept-quantized type: vpage loads them quantized (fused QKV and
gate/up projections included) and gives transformers' logits on the same dequantized weights;
a fused projection whose parts differ in type falls back to float."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_fixtures import PagedKVCache, save_tiny_gguf, save_tiny_model
from quant_fixtures import ALL_TYPES, dequantized, quantized_rows
from vpage import _core
from vpage.model_executor import load_model
from vpage.model_executor.layers.linear import Linear
from vpage.model_executor.layers.quant_linear import QuantizedEmbedding, QuantizedLinear

CASES = [*ALL_TYPES, "mixed"]


def _type_of(case: str, name: str) -> str:
    if case != "mixed":
        return case
    return "Q8_0" if ".k_proj." in name else "Q4_K" if ".mlp." in name else "Q4_0"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("case", CASES)
def test_tiny_quantized_gguf_matches_transformers(kind, case, tmp_path):
    import gguf

    folder = tmp_path / kind
    hf = save_tiny_model(kind, folder, hidden_size=256, intermediate_size=512)  # K types need 256 columns
    rng = np.random.default_rng(CASES.index(case))
    reference = {}

    def quantize(name, w):
        if w.ndim != 2:
            return None  # norms and biases stay F32
        qtype = _type_of(case, name)
        rows = quantized_rows(qtype, w, rng)
        reference[name] = torch.from_numpy(dequantized(qtype, rows).astype(np.float32))
        return rows, gguf.GGMLQuantizationType[qtype]

    path = tmp_path / f"{kind}-{case}.gguf"
    save_tiny_gguf(hf, folder, path, quantize)
    missing, unexpected = hf.load_state_dict(reference, strict=False)
    assert not unexpected and all("norm" in n or "bias" in n for n in missing)

    loaded = load_model(str(path), device="cpu")
    net = loaded.model
    layer = net.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Linear if case == "mixed" else QuantizedLinear)
    assert isinstance(layer.mlp.gate_up_proj, QuantizedLinear) and layer.mlp.gate_up_proj.qtype == _type_of(case, ".mlp.")
    assert isinstance(layer.self_attn.o_proj, QuantizedLinear)
    assert isinstance(net.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(net.lm_head, (QuantizedLinear, QuantizedEmbedding))  # tied: the embedding itself

    tokens = list(range(3, 30))
    cache = PagedKVCache(loaded.config)
    # The float path, whose accuracy the tolerances below are for: 27 rows of Q4_0/Q4_1/Q8_0
    # would take the integer GEMM, which rounds x to 8
    # bits per 32 values (its accuracy is tested in test_quant_matmul.py).
    _core.set_quant_integer_gemm_rows(0)
    try:
        logits = net.compute_logits(net(cache.step({0: tokens}), cache.caches))
    finally:
        _core.set_quant_integer_gemm_rows(_core.QUANT_INTEGER_GEMM_MAX_ROWS)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert ref.abs().max() > 0.1  # not a degenerate model
    torch.testing.assert_close(logits, ref, atol=1e-4 * ref.abs().max().item() + 1e-5, rtol=0)

    floats = load_model(str(path), device="cpu", quantization="none")
    assert isinstance(floats.model.model.layers[0].mlp.gate_up_proj, Linear)
    cache = PagedKVCache(floats.config)
    float_logits = floats.model.compute_logits(floats.model(cache.step({0: tokens}), cache.caches))
    torch.testing.assert_close(float_logits, logits, atol=1e-4 * ref.abs().max().item() + 1e-5, rtol=0)
