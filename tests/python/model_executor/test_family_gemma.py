"""Gemma 2 and Gemma 3 (text) against transformers: tiny random models (several layers of both
kinds, a head size that is not hidden / heads, random norm weights, soft-caps on) give
transformers' logits from a Hugging Face folder and from GGUF files (F32, Q8_0), with two
sequences fed in chunks and decode steps well past the sliding window; the engine gives
transformers' greedy tokens. What needs no kernel (configs, loaded weights, refusals) runs
everywhere; the forward tests wait for the windowed attention and the GELU / per-head norm
kernels."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from family_parity import assert_family_parity, setting_params
from model_fixtures import TINY_VOCAB, PagedKVCache, save_tiny_gguf, save_tiny_tokenizer
from quant_fixtures import dequantized, quantized_rows
from vpage import _core, ops
from vpage.model_executor import inspect_model, load_model
from vpage.model_executor.layer_types import sliding_windows
from vpage.model_executor.layers.quant_linear import QuantizedEmbedding, QuantizedLinear
from vpage.model_executor.loader.model_loader import load_hf_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HAS_KERNELS = ("sliding_window" in inspect.signature(ops.paged_attention).parameters
               and hasattr(ops, "gelu_tanh_and_mul") and hasattr(ops, "rms_norm_heads_"))
needs_kernels = pytest.mark.skipif(not HAS_KERNELS, reason="needs windowed / soft-capped paged attention and "
                                   "the gelu_tanh_and_mul and rms_norm_heads_ kernels")
WINDOW = 16
ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def gemma_config(kind: str, **overrides):
    """A tiny float32 Gemma2Config / Gemma3TextConfig: 4 (Gemma 2) or 7 (Gemma 3: five sliding,
    one global, one sliding) layers, window 16, head size 32 for hidden 64 / 4 heads, an
    attention scale of its own, weights large enough (std 0.15) that the soft-caps bite."""
    import transformers

    base = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                vocab_size=TINY_VOCAB, max_position_embeddings=256, sliding_window=WINDOW, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, initializer_range=0.15, tie_word_embeddings=True)
    if kind == "gemma2":
        fields = dict(num_hidden_layers=4, query_pre_attn_scalar=20, attn_logit_softcapping=2.0,
                      final_logit_softcapping=3.0, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
        return transformers.Gemma2Config(**{**base, **fields, **overrides})
    fields = dict(num_hidden_layers=7, query_pre_attn_scalar=40, final_logit_softcapping=3.0,
                  # transformers' Gemma 3 ignores an attention soft-cap; so must vpage.
                  attn_logit_softcapping=1.0,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                   "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0}})
    return transformers.Gemma3TextConfig(**{**base, **fields, **overrides})


def save_tiny_gemma(kind: str, folder, seed: int = 0, **overrides):
    """Build a random tiny Gemma (eager attention, norm weights drawn around 0 so that 1 + w
    matters), save it with a tokenizer into ``folder``; return it (eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gemma_config(kind, **overrides), dtype=torch.float32,
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(str(folder))
    save_tiny_tokenizer(folder)
    return model


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def tiny(request, tmp_path_factory):
    """(kind, folder, transformers model) of a saved tiny model."""
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save_tiny_gemma(request.param, folder, seed=3)


# Two sequences fed in one batch: prefill chunks of 21 / 9 then 16 / 19 tokens (past the
# window, across blocks of 8), one decode step of both, then decode steps of the first alone.
LENGTHS = (45, 29)
PLAN = [{0: (0, 21), 1: (0, 9)}, {0: (21, 37), 1: (9, 28)}, {0: (37, 38), 1: (28, 29)},
        *({0: (i, i + 1)} for i in range(38, 45))]
PREFILLED = (37, 28)  # tokens of each sequence fed by the prefill steps


def stepped_logits(loaded, seqs: list[list[int]]) -> list[torch.Tensor]:
    """vpage's logits of every token of ``seqs`` fed as ``PLAN`` says; one float32
    ``[len, vocab]`` per sequence."""
    cache = PagedKVCache(loaded.config, block_size=8)
    rows: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    net = loaded.model
    for step in PLAN:
        batch = cache.step({seq: seqs[seq][a:b] for seq, (a, b) in step.items()})
        logits = net.compute_logits(net(batch, cache.caches))
        starts = batch.query_start_loc.tolist()
        for i, seq in enumerate(step):
            rows[seq].append(logits[starts[i]:starts[i + 1]])
    return [torch.cat(rows[0]), torch.cat(rows[1])]


def random_prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def assert_matches_transformers(loaded, hf, atol: float = 1e-4, decode_atol: float | None = None) -> None:
    """vpage's stepped logits equal transformers' on the whole sequences (the decode steps'
    within ``decode_atol`` when given)."""
    seqs = random_prompts()
    for ours, tokens, prefilled in zip(stepped_logits(loaded, seqs), seqs, PREFILLED):
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0]
        assert ref.abs().max() > 0.5  # not a degenerate model
        torch.testing.assert_close(ours[:prefilled], ref[:prefilled], atol=atol, rtol=0)
        torch.testing.assert_close(ours[prefilled:], ref[prefilled:], atol=decode_atol or atol, rtol=0)


@needs_kernels
def test_folder_matches_transformers(tiny):
    kind, folder, hf = tiny
    loaded = load_model(str(folder), device="cpu")
    assert loaded.config.architecture == ARCHITECTURES[kind] and loaded.model.tie_word_embeddings
    assert_matches_transformers(loaded, hf)


@needs_kernels
def test_gemma2_layer_types_come_from_the_config(tmp_path):
    """A layer order other than the default alternation, and no final soft-cap."""
    layer_types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    hf = save_tiny_gemma("gemma2", tmp_path, seed=4, layer_types=layer_types, final_logit_softcapping=None)
    assert_matches_transformers(load_model(str(tmp_path), device="cpu"), hf)


def test_soft_caps_and_window_matter(tiny):
    """The comparison can fail: transformers' logits move by far more than the tolerance when
    a soft-cap is off or the window is wider (Gemma 3: no attention soft-cap to switch off)."""
    from transformers import AutoModelForCausalLM

    kind, folder, hf = tiny
    tokens = random_prompts()[0]
    changes = [dict(final_logit_softcapping=None), dict(sliding_window=4 * WINDOW)]
    if kind == "gemma2":
        changes.append(dict(attn_logit_softcapping=None))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
        for change in changes:
            other = AutoModelForCausalLM.from_config(gemma_config(kind, **change), dtype=torch.float32,
                                                     attn_implementation="eager").eval()
            other.load_state_dict(hf.state_dict())
            assert (other(torch.tensor([tokens])).logits[0] - ref).abs().max() > 1e-2, change


def test_norm_weights_load_as_one_plus_w(tiny, tmp_path):
    """The norms hold 1 + w from a folder and from a GGUF file (stored there as w + 1)."""
    kind, folder, hf = tiny
    path = tmp_path / f"{kind}.gguf"
    save_tiny_gguf(hf, folder, path)
    names = ["model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
             "model.layers.1.pre_feedforward_layernorm.weight", "model.layers.1.post_feedforward_layernorm.weight",
             "model.norm.weight"]
    if kind == "gemma3":
        names += ["model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"]
    hf_params = dict(hf.named_parameters())
    for source in (folder, path):
        params = dict(load_model(str(source), device="cpu").model.named_parameters())
        for name in names:
            torch.testing.assert_close(params[name], hf_params[name] + 1, atol=1e-7, rtol=0)


def test_gguf_config_matches_the_folder(tiny, tmp_path):
    """The transformers config rebuilt from GGUF metadata (llama.cpp's layer pattern, rope
    bases, soft-caps, scale) equals the original where llama.cpp can express it."""
    kind, folder, hf = tiny
    path = tmp_path / f"{kind}.gguf"
    save_tiny_gguf(hf, folder, path)
    cfg, ref = load_hf_config(str(path)), hf.config
    assert cfg.architectures == [ARCHITECTURES[kind]]
    assert list(cfg.layer_types) == list(ref.layer_types) and sliding_windows(cfg) == sliding_windows(ref)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.vocab_size) == (32, 2, TINY_VOCAB)
    assert cfg.final_logit_softcapping == ref.final_logit_softcapping and cfg.tie_word_embeddings
    assert cfg.query_pre_attn_scalar == 32  # llama.cpp: the head size (but for the 27B models)
    if kind == "gemma2":
        assert cfg.attn_logit_softcapping == ref.attn_logit_softcapping
        assert cfg.rope_parameters["rope_theta"] == 10000.0  # not stored: llama.cpp's default
    else:
        assert cfg.rope_parameters == ref.rope_parameters


def gguf_reference(kind: str, tmp_path, quantize=None):
    """A tiny model saved with query_pre_attn_scalar = the head size and (Gemma 2) rope base
    10000, as llama.cpp reads a GGUF file, and written as one; (loaded model, transformers model)."""
    folder = tmp_path / kind
    overrides = dict(query_pre_attn_scalar=32)
    if kind == "gemma2":
        overrides["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    hf = save_tiny_gemma(kind, folder, seed=5, **overrides)
    path = tmp_path / f"{kind}.gguf"
    reference: dict[str, torch.Tensor] = {}
    rng = np.random.default_rng(0)

    def q8(name, w):
        if w.ndim != 2:
            return None  # norms stay F32
        rows = quantized_rows("Q8_0", w, rng)
        reference[name] = torch.from_numpy(dequantized("Q8_0", rows).astype(np.float32))
        import gguf

        return rows, gguf.GGMLQuantizationType.Q8_0

    save_tiny_gguf(hf, folder, path, q8 if quantize else None)
    if reference:
        missing, unexpected = hf.load_state_dict(reference, strict=False)
        # lm_head is the embedding (tied), loaded through it
        assert not unexpected and all("norm" in n or n == "lm_head.weight" for n in missing)
    return load_model(str(path), device="cpu"), hf


@needs_kernels
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gguf_matches_transformers(kind, tmp_path):
    loaded, hf = gguf_reference(kind, tmp_path)
    assert loaded.config.architecture == ARCHITECTURES[kind]
    assert_matches_transformers(loaded, hf)


@needs_kernels
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_q8_0_gguf_matches_transformers(kind, tmp_path):
    """Q8_0 matrices kept quantized; transformers runs on the same dequantized weights. The
    prefill steps take the float path (exact up to float32 rounding); the decode steps (at most
    QUANT_INTEGER_PATH_ROWS rows) round the activations to 8 bits per 32 values as llama.cpp
    does, which over the layers of this deliberately large-weighted model moves the logits by
    up to about 5% of their range (greedy picks agree but for near-ties)."""
    loaded, hf = gguf_reference(kind, tmp_path, quantize=True)
    assert min(sum(b - a for a, b in step.values()) for step in PLAN[:2]) > _core.QUANT_INTEGER_PATH_ROWS
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear) and isinstance(layer.mlp.down_proj, QuantizedLinear)
    assert isinstance(loaded.model.lm_head, QuantizedEmbedding)  # tied: the embedding itself
    # The float path: the integer GEMM (few rows) rounds activations to 8 bits.
    _core.set_quant_integer_gemm_rows(0)
    try:
        assert_matches_transformers(loaded, hf, decode_atol=0.1 * 3.0)  # 3.0: the final soft-cap
    finally:
        _core.set_quant_integer_gemm_rows(_core.QUANT_INTEGER_GEMM_MAX_ROWS)


def test_multimodal_gemma3_folder_is_refused(tmp_path):
    import transformers

    text = gemma_config("gemma3").to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    transformers.Gemma3Config(text_config=text, vision_config=vision,
                              architectures=["Gemma3ForConditionalGeneration"]).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="unsupported model architecture 'Gemma3ForConditionalGeneration'.*"
                                         "Gemma3ForCausalLM"):
        load_model(str(tmp_path), device="cpu")


@pytest.mark.parametrize("change, message", [
    (dict(hidden_activation="gelu"), "unsupported Gemma activation 'gelu'"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
])
def test_unsupported_settings_are_refused(change, message, tmp_path):
    save_tiny_gemma("gemma3", tmp_path, **change)
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path), device="cpu")


@needs_kernels
@pytest.mark.parametrize("setting", setting_params(["plain", "chunked", "prefix", "preempt", "tp2"]))
def test_engine_matches_transformers(tiny, setting):
    kind, folder, hf = tiny
    if inspect_model(str(folder)).max_model_len <= WINDOW:
        pytest.skip("the engine still caps the context at the sliding window (needs the block manager's "
                    "per-layer windows)")
    assert_family_parity(folder, hf, [setting], prompt_len=40)
