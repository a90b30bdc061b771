"""Every rope kind (default, linear, llama3, yarn, longrope, dynamic NTK) against transformers:
the inverse frequencies and attention factor of ``ROPE_INIT_FUNCTIONS``, the rotation its
rotary module (with ``dynamic_rope_update``) applies at a given position and sequence length,
and tiny Llama models fed prompts, chunks and decode steps past the original length, logits
against transformers' forward over a KV cache fed the same pieces; engine-level greedy parity
for dynamic and YaRN models generating past their original length; kinds without a static
table stay off the C++ layer loop; unsupported kinds are refused by name."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from chunked_reference import assert_chunks_match, hf_logits_per_chunk
from family_parity import ENGINE_SETTINGS, assert_family_parity, engine_greedy, hf_greedy, setting_params
from model_fixtures import PagedKVCache, save_tiny_gguf, save_tiny_model
from vpage import ops
from vpage.model_executor import ForwardBatch, load_model
from vpage.model_executor.layers.rotary import SUPPORTED_ROPE_TYPES, RotaryEmbedding, rope_inv_freq

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEAD, THETA, MAX_POS, ORIGINAL = 16, 500.0, 128, 32
_SHORT = [1.0 + 0.13 * i for i in range(HEAD // 2)]
_LONG = [1.7 + 0.9 * i for i in range(HEAD // 2)]
SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn untruncated, betas": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                                "truncate": False, "beta_fast": 16, "beta_slow": 2},
    "yarn mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                    "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn attention factor, implicit factor": {"rope_type": "yarn", "factor": None, "attention_factor": 1.3,
                                               "original_max_position_embeddings": ORIGINAL},
    "longrope": {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG,
                 "original_max_position_embeddings": ORIGINAL},
    "longrope factor, attention factor": {"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG,
                                          "original_max_position_embeddings": ORIGINAL, "factor": 3.0,
                                          "attention_factor": 1.25},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
}
PARTIAL = {"yarn": SCALINGS["yarn"], "dynamic": SCALINGS["dynamic"],
           "longrope": {**SCALINGS["longrope"], "short_factor": _SHORT[:6], "long_factor": _LONG[:6]}}
_partial_kernel = pytest.mark.skipif("rotary_dim" not in inspect.signature(ops.rotary_embedding).parameters,
                                     reason="ops.rotary_embedding has no rotary_dim (partial rotary) yet")


def _config(scaling: dict, partial: float = 1.0):
    """A LlamaConfig as transformers standardises it (the rope_parameters vpage reads)."""
    from transformers import LlamaConfig

    params = {**scaling, "rope_theta": THETA}
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    return LlamaConfig(hidden_size=HEAD * 4, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=MAX_POS, rope_parameters=params)


@pytest.mark.parametrize("partial", [1.0, 0.75], ids=["full", "partial 0.75"])
@pytest.mark.parametrize("name", [n for n in SCALINGS if n != "default"])
def test_inv_freq_and_attention_factor_match_transformers(name, partial):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = SCALINGS[name]
    if partial != 1.0 and "longrope" in name:
        scaling = {**scaling, "short_factor": _SHORT[:6], "long_factor": _LONG[:6]}
    cfg = _config(scaling, partial)
    init = ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]]
    for seq_len in (None, 7, ORIGINAL, ORIGINAL + 1, MAX_POS, MAX_POS + 1, 5 * MAX_POS + 3):
        hf_inv, hf_attention = init(cfg, None, seq_len=None if seq_len is None else torch.tensor(seq_len))
        inv, attention = rope_inv_freq(HEAD, THETA, cfg.rope_parameters, MAX_POS, seq_len)
        assert inv.shape == (int(HEAD * partial) // 2,)
        torch.testing.assert_close(inv, hf_inv, rtol=1e-6, atol=0)
        assert attention == pytest.approx(hf_attention, rel=1e-12)
    if "longrope" in name or name == "dynamic":  # the long-context value differs from the short one
        assert not torch.equal(rope_inv_freq(HEAD, THETA, cfg.rope_parameters, MAX_POS, 3 * MAX_POS)[0],
                               rope_inv_freq(HEAD, THETA, cfg.rope_parameters, MAX_POS)[0])


def _batch(pieces: list[tuple[int, int]]) -> ForwardBatch:
    """Sequences fed positions ``start..end-1`` (so a context of ``end`` after the step)."""
    positions = torch.cat([torch.arange(s, e) for s, e in pieces])
    lens = torch.tensor([e - s for s, e in pieces])
    starts = torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0))).int()
    return ForwardBatch(input_ids=torch.zeros_like(positions), positions=positions,
                        slot_mapping=torch.full_like(positions, -1), block_tables=torch.zeros(len(pieces), 1).int(),
                        context_lens=torch.tensor([e for _, e in pieces]).int(), query_start_loc=starts,
                        max_context_len=max(e for _, e in pieces), max_query_len=int(lens.max()))


def _hf_rotated(cfg, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """transformers' rotation of ``x`` [tokens, heads, head] at positions start..end-1, by a
    fresh rotary module (its dynamic state starts anew) called as a forward over them is."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    rotary = LlamaRotaryEmbedding(cfg)
    cos, sin = rotary(x, torch.arange(start, end)[None])
    rotated, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    return rotated[0].transpose(0, 1)


# A prefill below the original length (32), a chunk that crosses it, a decode step past it, a
# decode step below it and a prefill past it, in one step; dynamic's original length is
# max_position_embeddings (128), which the static tables end at.
_PIECES = [(0, 20), (25, 41), (100, 101), (10, 11), (0, 120)]
_DYNAMIC_PIECES = [(0, 20), (110, 141), (300, 301), (10, 11), (0, 150)]


def _check_rotation(cfg, scaling_name: str):
    rotary = RotaryEmbedding(HEAD, THETA, cfg.rope_parameters, MAX_POS)
    pieces = _DYNAMIC_PIECES if rotary.kind == "dynamic" else _PIECES
    batch = _batch(pieces)
    gen = torch.Generator().manual_seed(3)
    heads = 5
    x = torch.randn(batch.num_tokens, heads * HEAD + 8, generator=gen)
    expected = x.clone()
    row = 0
    for start, end in pieces:
        rows = slice(row, row + end - start)
        heads_view = x[rows, : heads * HEAD].reshape(-1, heads, HEAD)
        expected[rows, : heads * HEAD] = _hf_rotated(cfg, heads_view, start, end).reshape(end - start, -1)
        row += end - start
    for _ in range(2):  # the second call reuses the step's plan
        got = x.clone()
        rotary.rotate_(got, batch, heads)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5, msg=scaling_name)
    assert torch.equal(got[:, heads * HEAD:], x[:, heads * HEAD:])


@pytest.mark.parametrize("name", list(SCALINGS))
def test_rotation_matches_transformers_per_sequence_length(name):
    _check_rotation(_config(SCALINGS[name]), name)


@_partial_kernel
@pytest.mark.parametrize("name", list(PARTIAL))
def test_partial_rotation_matches_transformers(name):
    _check_rotation(_config(PARTIAL[name], 0.75), name)


def test_step_plan_is_made_once_per_batch():
    rotary = RotaryEmbedding(HEAD, THETA, _config(SCALINGS["dynamic"]).rope_parameters, MAX_POS)
    first, second = _batch([(0, 200)]), _batch([(0, 200)])
    x = torch.randn(200, 2 * HEAD)
    rotary.rotate_(x.clone(), first, 2)
    table = rotary._step[3]
    rotary.rotate_(x.clone(), first, 2)
    assert rotary._step[3] is table
    rotary.rotate_(x.clone(), second, 2)
    assert rotary._step[0] is second and rotary._step[3] is not table
    assert RotaryEmbedding(HEAD, THETA, None, MAX_POS).cos_sin.shape == (MAX_POS, HEAD)


# Steps over two sequences (chunks as vpage feeds them): sequence 0 starts below the original
# length (32 for all but dynamic, whose original is max_position_embeddings) and crosses it
# in a chunk and in decode steps; sequence 1 starts past it.
_STEPS = [{0: 20, 1: 40}, {0: 10, 1: 1}, {0: 1, 1: 1}, {0: 5, 1: 1}, {0: 1, 1: 7}, {0: 1, 1: 1}]
_MODEL_SCALINGS = {
    "linear": SCALINGS["linear"], "llama3": SCALINGS["llama3"], "yarn": SCALINGS["yarn"],
    "yarn mscale": SCALINGS["yarn mscale"], "longrope": SCALINGS["longrope"],
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("name", list(_MODEL_SCALINGS))
def test_tiny_llama_matches_transformers_past_the_original_length(name, tmp_path):
    scaling = _MODEL_SCALINGS[name]
    max_pos = ORIGINAL if name == "dynamic" else MAX_POS
    hf = save_tiny_model("llama", tmp_path, rope_parameters={**scaling, "rope_theta": THETA},
                         max_position_embeddings=max_pos)
    assert all(sum(step[s] for step in _STEPS) > ORIGINAL for s in (0, 1))  # both end past the original length
    assert_chunks_match(load_model(str(tmp_path), device="cpu"), hf, _STEPS)


def test_chunked_prompt_rotates_each_chunk_at_its_own_context(tmp_path):
    """A longrope prompt crossing the original length in chunks is not the whole prompt at
    once: its first chunk keeps the short factors (as transformers fed the same chunks does)."""
    hf = save_tiny_model("llama", tmp_path, rope_parameters={**SCALINGS["longrope"], "rope_theta": THETA},
                         max_position_embeddings=MAX_POS)
    loaded = load_model(str(tmp_path), device="cpu")
    tokens = torch.randint(3, 320, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    whole_cache, chunk_cache = PagedKVCache(loaded.config), PagedKVCache(loaded.config)
    whole = loaded.model.compute_logits(loaded.model(whole_cache.step({0: tokens}), whole_cache.caches))
    loaded.model(chunk_cache.step({0: tokens[:24]}), chunk_cache.caches)
    last = loaded.model.compute_logits(loaded.model(chunk_cache.step({0: tokens[24:]}), chunk_cache.caches))
    assert (last - whole[24:]).abs().max() > 1e-3
    torch.testing.assert_close(last, hf_logits_per_chunk(hf, tokens, [24, 24])[1], atol=1e-4, rtol=0)


def test_kinds_without_a_static_table_stay_off_the_cpu_decoder(tmp_path):
    """A quantized GGUF Llama runs the C++ layer loop; with a dynamic or longrope rotary
    swapped in it runs the Python layers; a YaRN one keeps the loop (its table is static)."""
    import gguf
    import numpy as np

    from quant_fixtures import quantized_rows

    folder = tmp_path / "llama"
    hf = save_tiny_model("llama", folder, hidden_size=256, intermediate_size=512)
    rng = np.random.default_rng(0)
    path = tmp_path / "q8.gguf"
    save_tiny_gguf(hf, folder, path, lambda name, w: (quantized_rows("Q8_0", w, rng), gguf.GGMLQuantizationType.Q8_0)
                   if w.ndim == 2 else None)
    loaded = load_model(str(path), device="cpu")
    head = loaded.config.head_size
    for scaling, loop in ((SCALINGS["yarn"], True), (SCALINGS["dynamic"], False),
                          ({**SCALINGS["longrope"], "short_factor": [1.0] * (head // 2),
                            "long_factor": [2.0] * (head // 2)}, False)):
        loaded.model.model.rotary_emb = RotaryEmbedding(head, THETA, scaling, 256)
        cache = PagedKVCache(loaded.config)
        assert (loaded.model._decoder_for(cache.caches) is not None) == loop, scaling["rope_type"]


def test_unsupported_rope_type_is_refused(tmp_path):
    save_tiny_model("llama", tmp_path, rope_parameters={"rope_type": "proportional", "rope_theta": THETA,
                                                        "partial_rotary_factor": 0.5})
    supported = ", ".join(SUPPORTED_ROPE_TYPES)
    with pytest.raises(ValueError, match=f"{tmp_path}: unsupported rope scaling type 'proportional' "
                                         rf"\(supported: {supported}\)"):
        load_model(str(tmp_path), device="cpu")


@pytest.fixture(scope="module")
def dynamic_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dynamic")
    return folder, save_tiny_model("llama", folder, seed=7, max_position_embeddings=ORIGINAL,
                                   rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": THETA})


@pytest.fixture(scope="module")
def yarn_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("yarn")
    return folder, save_tiny_model("llama", folder, seed=8, max_position_embeddings=ORIGINAL,
                                   rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": THETA,
                                                    "original_max_position_embeddings": ORIGINAL})


@pytest.mark.parametrize("setting", setting_params(["plain", "chunked", "prefix", "preempt"]))
def test_engine_yarn_matches_transformers_past_the_original_length(yarn_model, setting):
    """YaRN's table is static: every engine setting matches, the second turn (83 tokens) and
    the generations run past the original 32 (the engine serves factor x 32)."""
    folder, hf = yarn_model
    assert_family_parity(folder, hf, [setting], prompt_len=40)


def test_engine_dynamic_matches_transformers_past_the_original_length(dynamic_model):
    """Dynamic NTK: prompts below the original 32 whose generations cross it, and a second
    turn (63 tokens) whose prefill is past it, in whole prefills."""
    folder, hf = dynamic_model
    assert_family_parity(folder, hf, ["plain"], prompt_len=20)


def test_engine_dynamic_chunked_prompts_below_the_original_length(dynamic_model):
    """Chunked prompts that end at or below the original length rotate as transformers does,
    and so do the decode steps past it."""
    folder, hf = dynamic_model
    prompts = [list(range(3, 27)), list(range(100, 124)), list(range(200, 229))]
    expected = [hf_greedy(copy.deepcopy(hf), p, 32) for p in prompts]
    assert engine_greedy(folder, prompts, 32, **ENGINE_SETTINGS["chunked"]) == expected


def test_a_window_inside_the_stretched_context_is_kept():
    """A YaRN model serves factor x its original length: a window past max_position_embeddings
    but inside that context still masks."""
    from model_fixtures import tiny_hf_config
    from vpage.model_executor.models.llama import layer_sliding_window

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": THETA}
    for window, kept in ((64, 64), (128, None)):
        cfg = tiny_hf_config("mistral", max_position_embeddings=32, sliding_window=window, rope_parameters=yarn)
        assert layer_sliding_window(cfg, 1) == kept
