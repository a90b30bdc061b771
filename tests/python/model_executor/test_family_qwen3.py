"""Qwen3 (dense): tiny random models (head_dim 32 for hidden 64 / 4 heads; tied and untied
embeddings) give transformers' logits from a Hugging Face folder and from GGUF files (F32,
Q8_0, Q4_K, as llama.cpp's converter writes them: attn_q_norm / attn_k_norm, no Q/K
permutation), and transformers' greedy tokens through the engine under every setting of the
parity harness."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from family_parity import assert_family_parity
from model_fixtures import PagedKVCache, save_tiny_gguf, save_tiny_model
from quant_fixtures import dequantized, quantized_rows
from vpage import _core, ops
from vpage.model_executor import load_model
from vpage.model_executor.layers.quant_linear import QuantizedLinear
from vpage.model_executor.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM

ATOL = 1e-4
HAS_HEADS_NORM = hasattr(ops, "rms_norm_heads_")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _reference_rms_norm_heads_(x, weight, eps, num_heads, head_size):
    """transformers' per-head RMSNorm, in place on the first ``num_heads`` heads of each row."""
    heads = x[:, : num_heads * head_size].view(x.shape[0], num_heads, head_size)
    normed = torch.nn.functional.rms_norm(heads.float(), (head_size,), eps=eps)
    heads.copy_(normed.to(x.dtype) * weight)


@pytest.fixture(autouse=True)
def heads_norm(monkeypatch):
    """Until the layer-kernels helper adds ``ops.rms_norm_heads_``, the model is checked with
    a torch stand-in for it (in this process only); once the kernel exists it is the one used."""
    if not HAS_HEADS_NORM:
        monkeypatch.setattr(ops, "rms_norm_heads_", _reference_rms_norm_heads_, raising=False)


def run_step(loaded, cache: PagedKVCache, chunks: dict[int, list[int]]) -> torch.Tensor:
    return loaded.model.compute_logits(loaded.model(cache.step(chunks), cache.caches))


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def assert_prefill_and_decode_match(hf, loaded, atol=ATOL):
    """A prompt in two chunks (the second over cached blocks), a second sequence beside it,
    then decode steps: every row's logits are transformers' on the whole sequence."""
    gen = torch.Generator().manual_seed(1)
    seqs = {0: torch.randint(3, 320, (29,), generator=gen).tolist(), 1: torch.randint(3, 320, (11,), generator=gen).tolist()}
    cache = PagedKVCache(loaded.config, block_size=8)
    first = run_step(loaded, cache, {0: seqs[0][:13], 1: seqs[1]})
    ref = torch.cat([hf_logits(hf, seqs[0][:13]), hf_logits(hf, seqs[1])])
    assert ref.abs().max() > 0.1  # not a degenerate model
    torch.testing.assert_close(first, ref, atol=atol, rtol=0)
    rest = run_step(loaded, cache, {0: seqs[0][13:]})
    torch.testing.assert_close(rest, hf_logits(hf, seqs[0])[13:], atol=atol, rtol=0)
    for _ in range(3):
        step = {s: [int(torch.randint(3, 320, (1,), generator=gen))] for s in seqs}
        for s, t in step.items():
            seqs[s] += t
        logits = run_step(loaded, cache, step)
        ref = torch.stack([hf_logits(hf, t)[-1] for t in seqs.values()])
        torch.testing.assert_close(logits, ref, atol=atol, rtol=0)


@pytest.fixture(scope="module", params=["untied", "tied"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"qwen3-{request.param}")
    hf = save_tiny_model("qwen3", folder, seed=3, tie_word_embeddings=request.param == "tied")
    return folder, hf


def test_hf_folder_matches_transformers(tiny):
    folder, hf = tiny
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    assert isinstance(loaded.model, Qwen3ForCausalLM) and loaded.config.architecture == "Qwen3ForCausalLM"
    assert loaded.config.head_size == 32 != hf.config.hidden_size // hf.config.num_attention_heads
    assert loaded.model.tie_word_embeddings == hf.config.tie_word_embeddings
    attn = loaded.model.model.layers[1].self_attn
    assert isinstance(attn, Qwen3Attention) and attn.attn.sliding_window is None
    torch.testing.assert_close(attn.k_norm.weight, hf.model.layers[1].self_attn.k_norm.weight, atol=0, rtol=0)
    # The C++ loop's structure (per-head norms included), but float weights: the Python layers run.
    assert loaded.model.has_cpu_decoder_structure()
    assert_prefill_and_decode_match(hf, loaded)


def test_the_head_norms_matter(tiny):
    """With q_norm / k_norm weights changed, vpage no longer gives transformers' logits (the
    norms are applied, and with the checkpoint's weights)."""
    folder, hf = tiny
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    for layer in loaded.model.model.layers:
        layer.self_attn.q_norm.weight.data.mul_(1.5)
    cache = PagedKVCache(loaded.config, block_size=8)
    tokens = list(range(3, 24))
    assert not torch.allclose(run_step(loaded, cache, {0: tokens}), hf_logits(hf, tokens), atol=1e-2)


def test_gguf_f32_matches_transformers(tiny, tmp_path):
    folder, hf = tiny
    path = tmp_path / "qwen3.gguf"
    save_tiny_gguf(hf, folder, path)
    loaded = load_model(str(path), device="cpu")
    assert loaded.config.architecture == "Qwen3ForCausalLM" and loaded.config.dtype == torch.float32
    assert loaded.config.head_size == 32 and loaded.config.num_kv_heads == 2
    assert loaded.model.tie_word_embeddings == hf.config.tie_word_embeddings
    assert_prefill_and_decode_match(hf, loaded)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_quantized_gguf_matches_transformers(qtype, tmp_path):
    """Matrices stored in ``qtype`` (norms F32): vpage keeps them quantized and gives
    transformers' logits on the same dequantized weights. head_dim 128 for hidden 256 and 4
    heads, so every matrix has a multiple of 256 columns (K types)."""
    import gguf

    folder = tmp_path / "qwen3"
    hf = save_tiny_model("qwen3", folder, seed=4, hidden_size=256, intermediate_size=512, head_dim=128)
    rng = np.random.default_rng(7)
    reference = {}

    def quantize(name, w):
        if w.ndim != 2:
            return None
        rows = quantized_rows(qtype, w, rng)
        reference[name] = torch.from_numpy(dequantized(qtype, rows).astype(np.float32))
        return rows, gguf.GGMLQuantizationType[qtype]

    path = tmp_path / f"qwen3-{qtype}.gguf"
    save_tiny_gguf(hf, folder, path, quantize)
    missing, unexpected = hf.load_state_dict(reference, strict=False)
    assert not unexpected and all("norm" in n for n in missing)
    loaded = load_model(str(path), device="cpu")
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear) and layer.self_attn.qkv_proj.qtype == qtype
    assert isinstance(layer.mlp.gate_up_proj, QuantizedLinear)
    tokens = list(range(3, 30))
    cache = PagedKVCache(loaded.config)
    # The float path the tolerance is for (the integer GEMM rounds x to 8 bits; its accuracy
    # is tested in test_quant_matmul.py); a near tie between two logits stays within it.
    _core.set_quant_integer_gemm_rows(0)
    try:
        logits = run_step(loaded, cache, {0: tokens})
    finally:
        _core.set_quant_integer_gemm_rows(_core.QUANT_INTEGER_GEMM_MAX_ROWS)
    ref = hf_logits(hf, tokens)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(logits, ref, atol=1e-4 * ref.abs().max().item() + 1e-5, rtol=0)


def test_unsupported_gguf_architecture_is_a_clear_error(tmp_path):
    import gguf

    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(str(path), arch="qwen3next")
    writer.add_tensor("token_embd.weight", np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"moe.gguf: unsupported GGUF architecture 'qwen3next'; supported: .*'qwen3'"):
        load_model(str(path), device="cpu")


# The worker processes of tensor parallelism cannot see the stand-in for the head-norm kernel.
_NEEDS_KERNEL = pytest.mark.skipif(not HAS_HEADS_NORM, reason="ops.rms_norm_heads_ not built yet")


@pytest.mark.parametrize("setting", [s if s != "tp2" else pytest.param(s, marks=[pytest.mark.slow, _NEEDS_KERNEL])
                                     for s in ["plain", "chunked", "prefix", "preempt", "tp2"]])
def test_engine_matches_transformers(tiny, setting):
    folder, hf = tiny
    if setting == "tp2" and not hf.config.tie_word_embeddings:
        pytest.skip("one tensor-parallel case per family: the tied model's")
    assert_family_parity(folder, hf, [setting], prompt_len=37)
