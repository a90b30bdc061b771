"""The C++ layer loop (models/cpu_decoder.py) on the families beyond the plain Llama: Qwen3
(per-head q/k norms), Gemma 2 (Gemma's layer structure, GELU-tanh MLP, attention logit
soft-cap, sliding layers), Gemma 3 (q/k norms, a rope table per layer type), Mistral, Qwen2
(a window on some layers) and Phi-3 (a window; partial rotary). Each tiny random model, written
as a GGUF file with Q8_0 or Q4_K matrices and random norm weights (or those dequantized and
packed for the dense kernel, float32 and bfloat16), gives bitwise the Python layers' hidden
states and KV caches over prefill chunks past the window and decode steps, with
the loop built; the window and the soft-cap it is given change its result; a part the loop does
not implement (longrope, a subclassed Gemma attention) keeps the model on the Python layers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from model_fixtures import _TINY, TINY_VOCAB, PagedKVCache, save_tiny_gguf, save_tiny_tokenizer, tiny_hf_config
from quant_fixtures import quantized_rows
from vpage.model_executor import load_model
from vpage.model_executor import models as registry
from vpage.model_executor.layers.linear import pack_dense_weights
from vpage.model_executor.loader import model_loader
from vpage.model_executor.models.gemma3 import Gemma3Attention, Gemma3ForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 16
# hidden 256 and head 64: every matrix's rows are a multiple of Q4_K's 256 values.
_SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
_GEMMA = dict(**_SIZES, vocab_size=TINY_VOCAB, max_position_embeddings=256, sliding_window=WINDOW, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, tie_word_embeddings=True, initializer_range=0.1)


def _config(family: str):
    """The transformers config of ``family`` (float32, tiny)."""
    import transformers

    if family == "qwen3":
        return tiny_hf_config("qwen3", **_SIZES)
    if family == "mistral":  # written as llama.cpp writes Mistral: arch llama
        return tiny_hf_config("llama", **_SIZES)
    if family == "qwen2":
        return tiny_hf_config("qwen2", **_SIZES, num_hidden_layers=3)
    if family.startswith("phi3"):
        rope = {"rope_type": "default", "rope_theta": 500.0}
        if family == "phi3-partial":  # Phi-4-mini-like: half of each head rotates, no window
            rope["partial_rotary_factor"] = 0.5
        elif family == "phi3-longrope":
            rope = {**rope, "rope_type": "longrope", "short_factor": [1.5] * 32, "long_factor": [3.0] * 32}
        sizes = {k: v for k, v in _SIZES.items() if k != "head_dim"}
        return transformers.Phi3Config(**{**_TINY, **sizes, "max_position_embeddings": 128,
                                          "original_max_position_embeddings": 32, "pad_token_id": None,
                                          "rope_parameters": rope,
                                          "sliding_window": WINDOW if family == "phi3-window" else None})
    if family == "gemma2":
        return transformers.Gemma2Config(**_GEMMA, num_hidden_layers=4, query_pre_attn_scalar=20,
                                          attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                          rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    assert family == "gemma3"  # five sliding layers, one global, one sliding
    return transformers.Gemma3TextConfig(
        **_GEMMA, num_hidden_layers=7, query_pre_attn_scalar=40, final_logit_softcapping=3.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0}})


# llama.cpp's llama and qwen2 metadata have no window: the windows of a Mistral (every layer)
# and a Qwen2 (use_sliding_window, max_window_layers=1: layers 1 and 2) join the config read
# from the file, as their transformers configs would give them.
_WINDOW_CONFIG = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
}


def _load(path: str, family: str, **options):
    fields = _WINDOW_CONFIG.get(family)
    if fields is None:
        return load_model(path, device="cpu", **options)
    read = model_loader._load_hf_config

    def windowed(*args, **kwargs):
        config = read(*args, **kwargs)
        for name, value in fields.items():
            setattr(config, name, value)
        return config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_loader, "_load_hf_config", windowed)
        return load_model(path, device="cpu", **options)


def _tiny_gguf(family: str, qtype: str, folder) -> str:
    """A random tiny model of ``family`` with random norm weights (Gemma's w around 0, as it
    stores 1 + w; the others' around 1), written as GGUF with ``qtype`` matrices."""
    import gguf
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.normal_(0.0 if family.startswith("gemma") else 1.0, 0.3)
    folder.mkdir(parents=True, exist_ok=True)
    save_tiny_tokenizer(folder)
    rng = np.random.default_rng(7)

    def quantize(name, w):
        return (quantized_rows(qtype, w, rng), gguf.GGMLQuantizationType[qtype]) if w.ndim == 2 else None

    path = folder / f"{family}-{qtype}.gguf"
    save_tiny_gguf(hf, folder, path, quantize)
    return str(path)


# Two sequences in one batch: prompts fed in chunks (21 / 9 tokens, then 16 / 19: past the
# 16-token window, across blocks of 8), a step mixing a decode token with a chunk, decode steps.
_PLAN = [{0: 21, 1: 9}, {0: 16, 1: 19}, {0: 1, 1: 1}, {0: 1, 1: 6}, {0: 1, 1: 1}, {0: 1}, {0: 1, 1: 1}]


def _run(loaded, use_cpu_decoder: bool, config=None):
    """(hidden states of every step of _PLAN, KV caches) on the loop or the Python layers."""
    net = loaded.model
    net.use_cpu_decoder = use_cpu_decoder
    cache = PagedKVCache(config or loaded.config, block_size=8, seed=3)
    gen = torch.Generator().manual_seed(0)
    hidden = []
    for step in _PLAN:
        chunks = {s: torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for s, n in step.items()}
        hidden.append(net(cache.step(chunks), cache.caches))
    built = net._cpu_decoder[0] is cache.caches and net._cpu_decoder[1] is not None
    assert built == use_cpu_decoder
    return hidden, cache.caches


def _assert_bitwise(fast, slow) -> None:
    (fast_hidden, fast_caches), (slow_hidden, slow_caches) = fast, slow
    assert fast_hidden[0].abs().max() > 0.1 and all(torch.isfinite(h).all() for h in fast_hidden)
    for a, b in zip(fast_hidden, slow_hidden):
        assert torch.equal(a, b)
    for (fk, fv), (sk, sv) in zip(fast_caches, slow_caches):
        assert torch.equal(fk, sk) and torch.equal(fv, sv)


FAMILIES = ["qwen3", "gemma2", "gemma3", "mistral", "qwen2", "phi3-window", "phi3-partial"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family, qtype) -> the loaded tiny GGUF model, each written and loaded once."""
    loaded = {}

    def get(family: str, qtype: str):
        if (family, qtype) not in loaded:
            folder = tmp_path_factory.mktemp(family)
            loaded[family, qtype] = _load(_tiny_gguf(family, qtype, folder), family)
        return loaded[family, qtype]

    return get


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loop_matches_python_layers_bitwise(models, family, qtype):
    loaded = models(family, qtype)
    net = loaded.model
    layers = net.model.layers
    assert net.has_cpu_decoder_structure()
    windows = [layer.self_attn.attn.sliding_window for layer in layers]
    expected_windows = {"qwen3": [None] * 2, "gemma2": [WINDOW, None] * 2, "mistral": [WINDOW] * 2,
                        "qwen2": [None, WINDOW, WINDOW], "phi3-window": [WINDOW] * 2, "phi3-partial": [None] * 2,
                        "gemma3": [WINDOW] * 5 + [None, WINDOW]}
    assert windows == expected_windows[family]
    if family == "phi3-partial":
        assert net.model.rotary_emb.rotary_dim == 32 < layers[0].self_attn.head_size
    if family == "gemma3":  # a rope table per layer type
        tables = [rotary.cos_sin for rotary in net.model.layer_rotary]
        assert not torch.equal(tables[0], tables[5]) and tables[0] is tables[6]
    _assert_bitwise(_run(loaded, True), _run(loaded, False))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loop_with_packed_float_weights_matches_python_layers_bitwise(tmp_path, family, dtype):
    loaded = _load(_tiny_gguf(family, "Q8_0", tmp_path), family, quantization="none", dtype=dtype)
    pack_dense_weights(loaded.model)
    fast = _run(loaded, True)
    assert fast[0][0].dtype == getattr(torch, dtype)
    _assert_bitwise(fast, _run(loaded, False))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])  # one family of each layer structure
def test_loop_with_a_16_bit_cache_matches_python_layers_bitwise(models, family, cache_dtype):
    loaded = models(family, "Q8_0")
    config = dataclasses.replace(loaded.config, kv_cache_dtype=cache_dtype)
    fast = _run(loaded, True, config)
    assert fast[1][0][0].dtype == cache_dtype
    _assert_bitwise(fast, _run(loaded, False, config))


def _set_attention(net, setting: str, values: list) -> None:
    """Every layer's attention ``setting`` (sliding_window or logits_soft_cap) to its value in
    ``values``, as PagedAttention takes it at construction; the loop is rebuilt on its next call."""
    for layer, value in zip(net.model.layers, values):
        attn = layer.self_attn.attn
        setattr(attn, setting, value)
        attn._options.pop(setting, None)
        if value is not None:
            attn._options[setting] = value
    net._cpu_decoder = (None, None)


@pytest.mark.parametrize("setting", ["sliding_window", "logits_soft_cap"])
def test_the_loop_applies_each_layers_window_and_soft_cap(models, setting):
    """The settings the loop takes change its result, as they change the Python layers'."""
    loaded = models("gemma2", "Q8_0")
    net = loaded.model
    before, _ = _run(loaded, True)
    original = [getattr(layer.self_attn.attn, setting) for layer in net.model.layers]
    assert any(value is not None for value in original)
    try:
        _set_attention(net, setting, [None] * len(original))
        after, _ = _run(loaded, True)
        python_after, _ = _run(loaded, False)
    finally:
        _set_attention(net, setting, original)
    assert all(torch.equal(a, b) for a, b in zip(after, python_after))
    assert (after[-1] - before[-1]).abs().max() > 1e-3


def test_longrope_phi3_stays_on_python_layers(tmp_path):
    """Longrope has no static table: the structure is the loop's, the rotary is not."""
    loaded = load_model(_tiny_gguf("phi3-longrope", "Q8_0", tmp_path), device="cpu")
    assert loaded.model.has_cpu_decoder_structure() and loaded.model.model.rotary_emb.cos_sin is None
    cache = PagedKVCache(loaded.config, block_size=8)
    assert torch.isfinite(loaded.model(cache.step({0: list(range(3, 40))}), cache.caches)).all()
    assert loaded.model._cpu_decoder == (cache.caches, None)


class _DoubledGemmaAttention(Gemma3Attention):
    """Gemma 3's attention with its output doubled: a part the loop does not implement (it
    states no role of its own)."""

    def forward(self, x, rotary, batch, kv_cache):
        return super().forward(x, rotary, batch, kv_cache).mul_(2)


class _DoubledGemma3(Gemma3ForCausalLM):
    parts = dataclasses.replace(Gemma3ForCausalLM.parts, attention=_DoubledGemmaAttention)


def test_a_gemma_with_a_part_the_loop_lacks_stays_on_python_layers(tmp_path, monkeypatch):
    path = _tiny_gguf("gemma3", "Q8_0", tmp_path)
    plain = load_model(path, device="cpu")
    monkeypatch.setitem(registry._BY_NAME, "Gemma3ForCausalLM", _DoubledGemma3)
    loaded = load_model(path, device="cpu")
    assert type(loaded.model) is _DoubledGemma3
    assert plain.model.has_cpu_decoder_structure() and not loaded.model.has_cpu_decoder_structure()
    hidden, _ = _run(loaded, False)
    loaded.model.use_cpu_decoder = True
    cache = PagedKVCache(loaded.config, block_size=8)
    loaded.model(cache.step({0: list(range(3, 30))}), cache.caches)
    assert loaded.model._cpu_decoder == (cache.caches, None)
    plain_hidden, _ = _run(plain, True)  # the plain model takes the loop; the doubled one differs
    assert (plain_hidden[0] - hidden[0]).abs().max() > 1e-3
