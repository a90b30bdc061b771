"""Llama 3.x as GGUF files carry it: llama.cpp's converter bakes the llama3 rope scaling into
``rope_freqs.weight`` (one divisor per frequency) and writes no scaling type; vpage divides
the frequencies by it and gives transformers' logits (untied, and Llama 3.2's tied
embeddings without output.weight), on the C++ layer loop for a quantized file; engine greedy
parity from the GGUF file and from the Hugging Face folder. Also the GGUF rope metadata vpage
reads (linear, yarn) or refuses by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunked_reference import assert_chunks_match
from family_parity import assert_family_parity, setting_params
from model_fixtures import PagedKVCache, save_tiny_gguf, save_tiny_model
from vpage.model_executor import load_model
from vpage.model_executor.layers.rotary import rope_inv_freq
from vpage.model_executor.models.arch import llama_gguf_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Head 64: llama3's short-, medium- and long-wavelength frequency bands all occur below 256.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}
SIZES = dict(hidden_size=256, intermediate_size=256, max_position_embeddings=256)
# Two sequences past the original length (64): prompts, a chunk, decode steps.
_STEPS = [{0: 50, 1: 70}, {0: 20, 1: 1}, {0: 1, 1: 1}, {0: 9, 1: 1}, {0: 1, 1: 1}]


def _gguf(tmp_path, tied: bool, seed: int = 0, quantize=None):
    folder = tmp_path / f"llama3-{tied}"
    hf = save_tiny_model("llama", folder, seed=seed, rope_parameters=LLAMA3, tie_word_embeddings=tied, **SIZES)
    path = tmp_path / f"llama3-{tied}.gguf"
    save_tiny_gguf(hf, folder, path, quantize)
    return hf, path


def test_rope_freqs_divide_to_transformers_llama3_frequencies(tmp_path):
    import gguf

    hf, path = _gguf(tmp_path, tied=False)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    factors = torch.from_numpy(np.array(tensors["rope_freqs.weight"].data))
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).sum() >= 3
    default, _ = rope_inv_freq(64, 10000.0, None)
    llama3, _ = rope_inv_freq(64, 10000.0, hf.config.rope_parameters)
    torch.testing.assert_close(default / factors, llama3, rtol=1e-6, atol=0)
    reader_fields = gguf.GGUFReader(str(path)).fields
    assert "llama.rope.scaling.type" not in reader_fields


@pytest.mark.parametrize("tied", [False, True], ids=["llama3.1 untied", "llama3.2 tied"])
def test_gguf_with_rope_freqs_matches_transformers(tied, tmp_path):
    hf, path = _gguf(tmp_path, tied)
    loaded = load_model(str(path), device="cpu")
    rope = loaded.hf_config.rope_parameters
    assert rope["rope_type"] == "default" and len(rope["freq_factors"]) == 32
    assert loaded.model.tie_word_embeddings == tied and (loaded.model.lm_head is loaded.model.model.embed_tokens) == tied
    assert_chunks_match(loaded, hf, _STEPS)


def test_quantized_gguf_with_rope_freqs_runs_the_cpu_decoder(tmp_path):
    """The factors make a static table: the C++ layer loop takes it, bit for bit the Python
    layers' result."""
    import gguf

    from quant_fixtures import quantized_rows

    rng = np.random.default_rng(1)
    _, path = _gguf(tmp_path, tied=False, quantize=lambda name, w: (
        (quantized_rows("Q8_0", w, rng), gguf.GGMLQuantizationType.Q8_0) if w.ndim == 2 else None))
    net = load_model(str(path), device="cpu")
    outputs = []
    for use_loop in (True, False):
        net.model.use_cpu_decoder = use_loop
        cache = PagedKVCache(net.config, seed=2)
        outputs.append([net.model(cache.step({0: list(range(3, 80))}), cache.caches),
                        net.model(cache.step({0: [90]}), cache.caches)])
        if use_loop:
            assert net.model._cpu_decoder == (cache.caches, net.model._cpu_decoder[1]) and net.model._cpu_decoder[1]
    assert outputs[0][0].abs().max() > 0.1
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama31")
    hf = save_tiny_model("llama", folder, seed=4, rope_parameters=LLAMA3, **SIZES)
    path = folder / "model.gguf"
    save_tiny_gguf(hf, folder, path)
    return folder, path, hf


@pytest.mark.parametrize("setting", setting_params(["plain", "chunked", "prefix", "tp2"]))
def test_engine_gguf_matches_transformers(llama31, setting):
    _, path, hf = llama31
    assert_family_parity(path, hf, [setting], prompt_len=70)


def test_engine_folder_matches_transformers_with_preemption(llama31):
    folder, _, hf = llama31
    assert_family_parity(folder, hf, ["preempt"], prompt_len=40)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 24.0, "beta_slow": 2.0},
], ids=["linear", "yarn"])
def test_gguf_rope_scaling_matches_transformers(scaling, tmp_path):
    folder = tmp_path / "llama"
    hf = save_tiny_model("llama", folder, rope_parameters={**scaling, "rope_theta": 500.0})
    path = tmp_path / "scaled.gguf"
    save_tiny_gguf(hf, folder, path)
    loaded = load_model(str(path), device="cpu")
    assert loaded.model.model.rotary_emb.kind == scaling["rope_type"]
    assert_chunks_match(loaded, hf, [{0: 40, 1: 7}, {0: 1, 1: 30}, {0: 1, 1: 1}])


class _Meta:
    """GGUF metadata as the config mappings read it, from plain dicts."""

    def __init__(self, keys: dict, tensors: dict):
        self.keys, self.tensors = keys, tensors

    def get(self, key, default=KeyError):
        if key in self.keys:
            return self.keys[key]
        if default is KeyError:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return default

    def get_global(self, key, default=None):
        return {"tokenizer.ggml.tokens": ["a"] * 10}.get(key, default)

    def has_tensor(self, name):
        return name in self.tensors or name == "output.weight"

    def tensor_values(self, name):
        return self.tensors[name]


_BASE_KEYS = {"attention.head_count": 4, "embedding_length": 64, "feed_forward_length": 128, "block_count": 2,
              "context_length": 128, "attention.layer_norm_rms_epsilon": 1e-5}


@pytest.mark.parametrize("keys, tensors, message", [
    ({"rope.scaling.type": "xpos"}, {}, r"GGUF rope scaling type 'xpos' is not supported \(supported: none, linear, "
                                        r"yarn, longrope\)"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32,
      "rope.scaling.yarn_attn_factor": 0.8}, {}, "GGUF YaRN rope with rope.scaling.yarn_attn_factor is not supported"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32},
     {"rope_freqs.weight": [1.0] * 8}, "GGUF rope_freqs with yarn scaling is not supported"),
    ({"rope.scaling.type": "longrope"}, {}, "GGUF longrope scaling without rope_factors_long/rope_factors_short"),
], ids=["unknown type", "yarn attention factor", "rope_freqs with yarn", "longrope without factors"])
def test_unsupported_gguf_rope_metadata_is_refused(keys, tensors, message):
    with pytest.raises(ValueError, match=message):
        llama_gguf_config(_Meta({**_BASE_KEYS, **keys}, tensors))


def test_gguf_rope_freqs_combine_with_linear_scaling():
    fields = llama_gguf_config(_Meta({**_BASE_KEYS, "rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
                                     {"rope_freqs.weight": [1.0, 2.0, 4.0, 8.0] * 2}))
    scaling = fields["rope_scaling"]
    assert scaling == {"rope_type": "linear", "factor": 2.0, "freq_factors": [1.0, 2.0, 4.0, 8.0] * 2}
    inv, _ = rope_inv_freq(16, 10000.0, scaling)
    torch.testing.assert_close(inv, rope_inv_freq(16, 10000.0, None)[0] / 2 / torch.tensor(scaling["freq_factors"]))
