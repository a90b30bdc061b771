"""The C++ layer loop (models/cpu_decoder.py) against the layer-by-layer Python path on tiny
quantized Llama and Qwen2 (biased QKV) models, and on their float weights packed for the dense
kernel (float32, bfloat16 and float16 activations): the same hidden states and KV caches bit
for bit over prefill, chunked prefill and decode steps; models that do not qualify stay on the
Python path (float weights not packed; a family built on Llama with an extra norm, or one that
does not opt in); a malformed batch is refused before anything runs."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from model_fixtures import PagedKVCache, save_tiny_gguf, save_tiny_model
from quant_fixtures import quantized_rows
from vpage import ops
from vpage.model_executor import load_model
from vpage.model_executor import models as registry
from vpage.model_executor.layers.linear import pack_dense_weights
from vpage.model_executor.layers.quant_linear import QuantizedLinear
from vpage.model_executor.layers.rms_norm import RMSNorm
from vpage.model_executor.models.llama import DecoderParts, LlamaAttention, LlamaForCausalLM

# Steps over three sequences: whole prompts of awkward lengths, a chunk that continues a
# prompt (its context is longer than its query), then decode steps, one mixed with a chunk.
_STEPS = [
    {0: list(range(3, 16)), 1: list(range(20, 25))},
    {2: list(range(40, 49)), 0: list(range(50, 57))},
    {0: [60], 1: [61], 2: [62]},
    {1: [63], 2: list(range(64, 70))},
    {0: [71], 1: [72], 2: [73]},
]


def _tiny_gguf(kind: str, qtype: str, tmp_path) -> str:
    import gguf

    folder = tmp_path / kind
    hf = save_tiny_model(kind, folder, hidden_size=256, intermediate_size=512)
    rng = np.random.default_rng(7)

    def quantize(name, w):
        if w.ndim != 2:
            return None
        return quantized_rows(qtype, w, rng), gguf.GGMLQuantizationType[qtype]

    path = tmp_path / f"{kind}-{qtype}.gguf"
    save_tiny_gguf(hf, folder, path, quantize)
    return str(path)


def _run(net, use_cpu_decoder: bool):
    net.use_cpu_decoder = use_cpu_decoder
    cache = PagedKVCache(net_config[id(net)], seed=3)
    hidden = [net(cache.step(chunks), cache.caches) for chunks in _STEPS]
    if use_cpu_decoder:
        assert net._cpu_decoder == (cache.caches, net._cpu_decoder[1]) and net._cpu_decoder[1] is not None
    return hidden, cache.caches


net_config: dict[int, object] = {}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_cpu_decoder_matches_python_layers_bitwise(kind, qtype, tmp_path):
    loaded = load_model(_tiny_gguf(kind, qtype, tmp_path), device="cpu")
    net = loaded.model
    net_config[id(net)] = loaded.config
    fast_hidden, fast_caches = _run(net, True)
    slow_hidden, slow_caches = _run(net, False)
    assert fast_hidden[0].abs().max() > 0.1  # a real signal, not zeros
    for fast, slow in zip(fast_hidden, slow_hidden):
        assert torch.equal(fast, slow)
    for (fk, fv), (sk, sv) in zip(fast_caches, slow_caches):
        assert torch.equal(fk, sk) and torch.equal(fv, sv)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_cpu_decoder_with_a_16_bit_cache_matches_python_layers_bitwise(cache_dtype, tmp_path):
    loaded = load_model(_tiny_gguf("llama", "Q4_1", tmp_path), device="cpu")
    net = loaded.model
    net_config[id(net)] = loaded.config
    float_hidden, _ = _run(net, True)
    net_config[id(net)] = dataclasses.replace(loaded.config, kv_cache_dtype=cache_dtype)
    fast_hidden, fast_caches = _run(net, True)
    slow_hidden, slow_caches = _run(net, False)
    assert fast_caches[0][0].dtype == cache_dtype and fast_caches[0][0].abs().max() > 0.1
    for fast, slow in zip(fast_hidden, slow_hidden):
        assert torch.equal(fast, slow)
    for (fk, fv), (sk, sv) in zip(fast_caches, slow_caches):
        assert torch.equal(fk, sk) and torch.equal(fv, sv)
    # Close to the float32 cache's hidden states: K/V's rounding to 16 bits moves the attention
    # output a little, and the integer matmuls' 8-bit rounding of their inputs (1/254 of a
    # block's largest value) turns that into differences of about 1%.
    for fast, exact in zip(fast_hidden, float_hidden):
        error = (fast - exact).abs().max() / exact.abs().max()
        assert 0 < error < 0.05


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_packed_float_model_matches_python_layers_bitwise(kind, dtype, tmp_path):
    save_tiny_model(kind, tmp_path / kind, hidden_size=256, intermediate_size=512)
    loaded = load_model(str(tmp_path / kind), dtype=dtype, device="cpu")
    net = loaded.model
    pack_dense_weights(net)
    assert net.model.layers[0].self_attn.qkv_proj.packed.dtype == getattr(torch, dtype)
    net_config[id(net)] = loaded.config
    fast_hidden, fast_caches = _run(net, True)
    slow_hidden, slow_caches = _run(net, False)
    assert fast_hidden[0].dtype == getattr(torch, dtype) and fast_hidden[0].abs().max() > 0.1
    for fast, slow in zip(fast_hidden, slow_hidden):
        assert torch.equal(fast, slow)
    for (fk, fv), (sk, sv) in zip(fast_caches, slow_caches):
        assert torch.equal(fk, sk) and torch.equal(fv, sv)


def test_unpacked_float_model_stays_on_python_layers(tmp_path):
    loaded = load_model(_tiny_gguf("llama", "Q4_0", tmp_path), device="cpu", quantization="none")
    net = loaded.model
    cache = PagedKVCache(loaded.config)
    net(cache.step(_STEPS[0]), cache.caches)
    assert net._cpu_decoder == (cache.caches, None)


def test_malformed_batch_is_refused_and_the_loop_stays_usable(tmp_path):
    loaded = load_model(_tiny_gguf("llama", "Q4_0", tmp_path), device="cpu")
    net = loaded.model
    cache = PagedKVCache(loaded.config)
    batch = cache.step(_STEPS[0])
    bad = torch.tensor(batch.positions.tolist(), dtype=torch.int32)
    with pytest.raises(ValueError, match="int64"):
        net(type(batch)(**{**batch.__dict__, "positions": bad}), cache.caches)
    far = batch.positions.clone()
    far[3] = 10**6  # beyond the rotary table: the C++ kernel refuses it
    with pytest.raises(ValueError, match="position"):
        net(type(batch)(**{**batch.__dict__, "positions": far}), cache.caches)
    assert torch.isfinite(net(batch, cache.caches)).all()


class _QNormAttention(LlamaAttention):
    """Llama's attention with a per-head RMSNorm of the queries before rotary (Qwen3's shape)."""

    def __init__(self, hf_config, dtype, quant, prefix, layer_index):
        super().__init__(hf_config, dtype, quant, prefix, layer_index)
        self.q_norm = RMSNorm(self.head_size, hf_config.rms_norm_eps, dtype)

    def position_qk(self, q, k, rotary, positions):
        heads = q.reshape(-1, self.head_size)
        normed = torch.empty_like(heads)
        ops.rms_norm(normed, heads, self.q_norm.weight, self.q_norm.eps)
        q.copy_(normed.view(q.shape))
        super().position_qk(q, k, rotary, positions)


class _QNormLlama(LlamaForCausalLM):
    parts = DecoderParts(attention=_QNormAttention)

    def load_weights(self, weights):
        norms = [(f"model.layers.{i}.self_attn.q_norm.weight", torch.full((layer.self_attn.head_size,), 1.5))
                 for i, layer in enumerate(self.model.layers)]
        super().load_weights(itertools.chain(weights, norms))


class _OptedOutLlama(LlamaForCausalLM):
    cpu_decoder_structure = None


@pytest.mark.parametrize("model_class", [_QNormLlama, _OptedOutLlama])
def test_a_family_the_loop_does_not_implement_stays_on_python_layers(model_class, tmp_path, monkeypatch):
    path = _tiny_gguf("llama", "Q4_1", tmp_path)
    plain = load_model(path, device="cpu")
    monkeypatch.setitem(registry._BY_NAME, "LlamaForCausalLM", model_class)
    loaded = load_model(path, device="cpu")
    net = loaded.model
    assert type(net) is model_class and isinstance(net.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert plain.model.has_cpu_decoder_structure() and not net.has_cpu_decoder_structure()
    net_config[id(net)] = net_config[id(plain.model)] = loaded.config
    hidden, _ = _run(net, False)
    net.use_cpu_decoder = True
    cache = PagedKVCache(loaded.config, seed=3)
    assert torch.equal(net(cache.step(_STEPS[0]), cache.caches), hidden[0])
    assert net._cpu_decoder == (cache.caches, None)
    plain_hidden, _ = _run(plain.model, True)  # the plain model takes the loop on the same file
    assert torch.equal(plain_hidden[0], hidden[0]) == (model_class is _OptedOutLlama)
