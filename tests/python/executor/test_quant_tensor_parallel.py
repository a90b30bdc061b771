"""GGUF weights kept quantized under tensor parallelism (CPU). Tiny random Llama/Qwen2 GGUF
files (Q8_0; Q4_1 attention and Q4_0 MLP; Q4_K with Q6_K down projection and output) whose
row-parallel splits land on block boundaries: each rank keeps whole blocks (the shards' bytes
put together are the unsharded weight's), and with tp = 2 and 3 the engine gives the
unsharded quantized path's greedy tokens and, within a bound, its logprobs. A size that would
cut a layer's blocks leaves that layer float with one warning; the default model stays
quantized with tp = 3 (a third of its weight bytes per rank) and matches tp = 1 but at near-ties.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from bounded_loops import bounded
from model_fixtures import save_tiny_gguf, save_tiny_model
from quant_fixtures import quantized_rows
from test_tensor_parallel import PROMPTS, children, make_engine
from vpage import EngineArgs, LLMEngine, SamplingParams, ops
from vpage.distributed import parallel_state as ps
from vpage.model_executor import load_model
from vpage.model_executor.layers.parallel_linear import RowParallelLinear
from vpage.model_executor.layers.quant_linear import (QuantizedEmbedding, QuantizedLinear,
                                                      QuantizedRowParallelLinear)
from vpage.model_executor.layers.weight_utils import QuantizedTensor, weight_loader_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# How far a chosen token's logprob may move from tp = 1's. The all-reduce changes only the float
# summation order (partial products added over the ranks; the layer test below checks they add
# up to the whole product within 1e-5), but Q4_0/Q4_1/Q8_0 matmuls (and Q4_K's at decode sizes)
# round x to 8 bits per 32 values, and a last-bit change of an input flips some roundings: seen
# up to 8e-3 over 2 layers (and 0.01-0.1 between these files' quantized and dequantized float32
# paths at tp = 1).
ROUNDED_X = 0.05
# name: (kind, tiny-config overrides, layer -> GGUF type, logprob bound). Sizes: o_proj's and
# down_proj's input columns over 2 and over 3 ranks are whole 32-value blocks (192, 384, 768
# columns); for the 256-value K blocks, down_proj's 1536 are (768, 512 per rank), o_proj's 768
# only over 3 ranks (over 2: 384 per rank, so o_proj stays float there).
CASES = {
    "llama Q8_0, untied, padded vocab": (
        "llama", dict(hidden_size=192, intermediate_size=384, num_attention_heads=6, num_key_value_heads=6),
        lambda name: "Q8_0", ROUNDED_X),
    "qwen2 Q4_1 attention, Q4_0 MLP, tied Q8_0, KV replicated": (
        "qwen2", dict(hidden_size=384, intermediate_size=768, num_attention_heads=6, num_key_value_heads=1,
                      tie_word_embeddings=True),
        lambda name: "Q4_1" if ".self_attn." in name else "Q4_0" if ".mlp." in name else "Q8_0", ROUNDED_X),
    "llama Q4_K, Q6_K down and output": (
        "llama", dict(hidden_size=768, intermediate_size=1536, num_attention_heads=6, num_key_value_heads=6),
        lambda name: "Q6_K" if "down_proj" in name or name.startswith("lm_head") else
        "Q8_0" if "embed_tokens" in name else "Q4_K", ROUNDED_X),
}
K_CASE = "llama Q4_K, Q6_K down and output"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    import gguf

    out = {}
    for i, (name, (kind, overrides, type_of, _)) in enumerate(CASES.items()):
        folder = tmp_path_factory.mktemp(kind)
        hf = save_tiny_model(kind, folder, seed=5, **overrides)
        rng = np.random.default_rng(i)

        def quantize(tensor_name, w, type_of=type_of, rng=rng):
            if w.ndim != 2:
                return None  # norms and biases stay F32
            qtype = type_of(tensor_name)
            return quantized_rows(qtype, w, rng), gguf.GGMLQuantizationType[qtype]

        path = folder / "model.gguf"
        save_tiny_gguf(hf, folder, path, quantize)
        out[name] = path
    return out


def load_rank(path, rank: int, size: int):
    """Rank ``rank``'s shard of the model at ``path`` of ``size`` ranks (no process group)."""
    ps.set_tensor_parallel_for_testing(rank, size)
    try:
        return load_model(None if path is None else str(path), device="cpu").model
    finally:
        ps.set_tensor_parallel_for_testing(0, 1)


def weight_bytes(net) -> int:
    return sum(p.numel() * p.element_size() for p in net.parameters())


def generate(engine: LLMEngine, prompts, params):
    """The first completion of each prompt, in prompt order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done = {}
    for _ in bounded(engine.has_unfinished_requests, 10_000, "requests still unfinished"):
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0]
    return [done[i] for i in range(len(prompts))]


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def unsharded(ggufs):
    """The tp = 1 quantized path's outputs per case (the C++ layer loop, bitwise the Python layers)."""
    out = {}
    for name, path in ggufs.items():
        engine = make_engine(path)
        layers = engine.executor.driver_worker.loaded.model.model.layers
        assert isinstance(layers[0].mlp.down_proj, QuantizedLinear)
        out[name] = generate(engine, PROMPTS, GREEDY)
    return out


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_quantized_shards_match_the_unsharded_quantized_path(ggufs, unsharded, case, tp):
    engine = make_engine(ggufs[case], tp)
    try:
        net = engine.executor.driver_worker.loaded.model
        layer = net.model.layers[0]
        assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear)
        assert isinstance(layer.mlp.gate_up_proj, QuantizedLinear)
        assert isinstance(layer.mlp.down_proj, QuantizedRowParallelLinear)
        o_proj_cut = case == K_CASE and tp == 2
        assert isinstance(layer.self_attn.o_proj, RowParallelLinear if o_proj_cut else QuantizedRowParallelLinear)
        assert isinstance(net.model.embed_tokens, QuantizedEmbedding) and isinstance(net.lm_head, QuantizedEmbedding)
        got = generate(engine, PROMPTS, GREEDY)
    finally:
        engine.shutdown()
    assert not children()
    # Rounded x moves logprobs by up to the case's bound, so a near-tie may flip: the outputs are
    # equal up to a token that tp = 1 ranked within twice the bound of its best, and each step's
    # top 5 agree but for a near-tie at the fifth place.
    bound, worst, equal = CASES[case][3], 0.0, 0
    for ours, expected in zip(got, unsharded[case]):
        first = next((i for i, (a, b) in enumerate(zip(ours.token_ids, expected.token_ids)) if a != b), None)
        equal += first is None
        if first is not None:
            top = expected.logprobs[first]
            assert ours.token_ids[first] in top
            assert max(lp.logprob for lp in top.values()) - top[ours.token_ids[first]].logprob < 2 * bound
        for token, mine, theirs in zip(ours.token_ids[:first], ours.logprobs, expected.logprobs):
            assert token in mine and token in theirs and len(mine.keys() & theirs.keys()) >= 4
            worst = max(worst, *(abs(mine[t].logprob - theirs[t].logprob) for t in mine.keys() & theirs.keys()))
    assert worst < bound and equal >= len(got) - 1


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_shards_hold_whole_blocks_of_the_unsharded_weights(ggufs, case, size):
    full = load_rank(ggufs[case], 0, 1)
    shards = [load_rank(ggufs[case], rank, size) for rank in range(size)]
    x = torch.randn(5, full.model.layers[0].mlp.down_proj.cols, generator=torch.Generator().manual_seed(0))
    for i, layer in enumerate(full.model.layers):
        parts = [shard.model.layers[i].mlp.down_proj for shard in shards]
        # Of every row, rank r keeps the bytes of blocks [r * blocks / size, (r + 1) * blocks / size).
        assert torch.equal(torch.cat([p.qweight for p in parts], dim=1), layer.mlp.down_proj.qweight)
        # The ranks' partial products add up to the whole product (the all-reduce's sum).
        partial = sum(p.linear(x[:, r * p.cols:(r + 1) * p.cols].contiguous()) for r, p in enumerate(parts))
        whole = layer.mlp.down_proj.linear(x)
        torch.testing.assert_close(partial, whole, atol=1e-5 * whole.abs().max().item(), rtol=0)
        o_parts = [shard.model.layers[i].self_attn.o_proj for shard in shards]
        if all(isinstance(p, QuantizedRowParallelLinear) for p in o_parts):
            assert torch.equal(torch.cat([p.qweight for p in o_parts], dim=1), layer.self_attn.o_proj.qweight)
    # The tables keep whole vocabulary rows; the last rank's rows past the vocabulary are zeros.
    table = full.model.embed_tokens.qweight
    rows = torch.cat([shard.model.embed_tokens.qweight for shard in shards])
    assert torch.equal(rows[:table.shape[0]], table) and not rows[table.shape[0]:].any()
    if case != K_CASE or size != 2:  # (there o_proj's float columns outweigh its whole Q4_K rows)
        assert all(weight_bytes(shard) < 0.55 * weight_bytes(full) for shard in shards)


def test_row_parallel_bias_is_added_once_after_the_sum(monkeypatch):
    # No GGUF family here has a row-parallel bias, so the layers are built directly.
    from vpage.model_executor.layers import quant_linear

    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 768)).astype(np.float32)
    checkpoint = QuantizedTensor(torch.from_numpy(quantized_rows("Q8_0", w, rng)), 8, 768)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(2))

    def build() -> QuantizedLinear:
        layer = (QuantizedRowParallelLinear if ps.tp_size() > 1 else QuantizedLinear)(768, 16, True, torch.float32,
                                                                                       "Q8_0")
        for param in (layer.qweight, layer.bias):
            weight_loader_of(param)(param, checkpoint if param is layer.qweight else bias, None)
        return layer

    whole = build()(x)
    parts = []
    for rank in range(3):
        ps.set_tensor_parallel_for_testing(rank, 3)
        try:
            parts.append(build())
        finally:
            ps.set_tensor_parallel_for_testing(0, 1)
    slices = [x[:, r * 256:(r + 1) * 256].contiguous() for r in range(3)]
    total = sum(p.linear(s) for p, s in zip(parts, slices))
    monkeypatch.setattr(quant_linear, "all_reduce", lambda y: y.copy_(total))  # what the ranks' sum gives
    for part, piece in zip(parts, slices):
        torch.testing.assert_close(part(piece), whole, atol=1e-5 * whole.abs().max().item(), rtol=0)


def test_a_layer_whose_shard_would_cut_blocks_stays_float_with_one_warning(ggufs, caplog):
    path = ggufs[K_CASE]
    full = load_rank(path, 0, 1)
    for rank in (0, 1):
        with caplog.at_level(logging.WARNING, logger="vpage"):
            caplog.clear()
            shard = load_rank(path, rank, 2)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        if rank == 0:
            assert len(warnings) == 1, warnings
            assert ("tensor_parallel_size 2 would cut GGUF blocks" in warnings[0]
                    and "self_attn.o_proj (2 layers: 768 input columns in Q4_K blocks of 256 values, 384 per rank; "
                        "sizes that keep its blocks whole: [1, 3])" in warnings[0]
                    and "down_proj" not in warnings[0]), warnings[0]
        else:
            assert not warnings  # rank 0 speaks for all
        for i, layer in enumerate(shard.model.layers):
            o_proj = layer.self_attn.o_proj
            assert isinstance(o_proj, RowParallelLinear) and o_proj.weight.dtype == torch.float32
            whole = ops.dequantize_rows(full.model.layers[i].self_attn.o_proj.qweight, "Q4_K", 768)
            assert torch.equal(o_proj.weight, whole[:, rank * 384:(rank + 1) * 384])
            assert isinstance(layer.mlp.down_proj, QuantizedRowParallelLinear) and layer.mlp.down_proj.qtype == "Q6_K"
            assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear) and layer.self_attn.qkv_proj.qtype == "Q4_K"
    with caplog.at_level(logging.WARNING, logger="vpage"):
        caplog.clear()
        load_rank(path, 0, 3)
    assert not caplog.records


def test_default_model_stays_quantized_with_three_ranks(caplog):
    # 9 heads and 3 KV heads split over 1 or 3 ranks; with 3, o_proj's 576 columns (192 per
    # rank) and down_proj's 1536 (512) are whole 32-value Q4_1 blocks.
    with caplog.at_level(logging.WARNING, logger="vpage"):
        net = load_rank(None, 2, 3)
    assert not caplog.records
    for layer in net.model.layers:
        assert isinstance(layer.self_attn.qkv_proj, QuantizedLinear) and layer.self_attn.qkv_proj.qtype == "Q4_1"
        assert isinstance(layer.self_attn.o_proj, QuantizedRowParallelLinear)
        assert isinstance(layer.mlp.gate_up_proj, QuantizedLinear)
        assert isinstance(layer.mlp.down_proj, QuantizedRowParallelLinear)
    assert net.lm_head is net.model.embed_tokens and net.lm_head.qtype == "Q8_0"
    assert net.lm_head.qweight.shape[0] == 49152 // 3
    # Unsharded: 92 MB quantized (test_quant_engine.py); float32 would be ~540 MB, ~180 MB a rank.
    assert weight_bytes(net) < 35 * 2**20


def test_default_model_with_three_ranks_matches_one_except_near_ties():
    # 30 layers of Q4_1 matmuls that round x to 8 bits: the all-reduce's last-bit changes flip
    # some roundings and grow over the layers (seen: logprobs moved up to 0.13, 2 of 4 prompts
    # diverging after 8+ equal tokens), as between the quantized and float paths
    # (test_quant_engine.py, whose near-tie rule this is).
    from default_model_prompts import PROMPTS as TEXTS
    near_tie = 0.5  # as in test_quant_engine.py (NEAR_TIE there)

    prompts, params = TEXTS[:4], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    args = dict(dtype="float32", kv_cache_memory=0.05, max_model_len=256)
    expected = generate(LLMEngine(EngineArgs(num_threads=1, **args)), prompts, params)
    engine = LLMEngine(EngineArgs(num_threads=3, tensor_parallel_size=3, **args))
    try:
        assert isinstance(engine.executor.driver_worker.loaded.model.model.layers[0].mlp.down_proj,
                          QuantizedRowParallelLinear)
        got = generate(engine, prompts, params)
    finally:
        engine.shutdown()
    assert not children()
    equal = 0
    for ours, theirs in zip(got, expected):
        first = next((i for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)) if a != b), None)
        equal += first is None or first >= 4
        if first is not None:  # the token chosen is within near_tie of tp = 1's best there
            top = theirs.logprobs[first]
            assert ours.token_ids[first] in top
            assert max(lp.logprob for lp in top.values()) - top[ours.token_ids[first]].logprob < near_tie
        for mine, ref, token in zip(ours.logprobs[:first], theirs.logprobs[:first], ours.token_ids):
            assert abs(mine[token].logprob - ref[token].logprob) < near_tie
    assert equal >= len(prompts) - 1  # the first 4 tokens agree (seen: 8 or more on all 4)


def test_bad_combinations_are_clear_errors(ggufs):
    with pytest.raises(ValueError, match=r"cannot split 9 attention heads and 3 KV heads.*"
                                         r"sizes that work are \[1, 3, 9\]"):
        LLMEngine(EngineArgs(tensor_parallel_size=2, kv_cache_memory=0.01))
    assert not children()
    ps.set_tensor_parallel_for_testing(1, 2)
    try:
        with pytest.raises(ValueError, match=r"tensor_parallel_size 2 would cut the Q4_K blocks of 768 input columns; "
                                             r"sizes that keep them whole: \[1, 3\]"):
            QuantizedRowParallelLinear(768, 16, False, torch.float32, "Q4_K")
        layer = QuantizedRowParallelLinear(768, 16, False, torch.float32, "Q8_0")
        param = layer.qweight
        half = QuantizedTensor(torch.zeros(16, ops.quant_row_bytes("Q8_0", 384), dtype=torch.uint8), 8, 384)
        with pytest.raises(ValueError, match=r"\(ggml type 8, 384 columns\) does not match the quantized parameter "
                                             r"\(Q8_0, 768 columns\)"):
            weight_loader_of(param)(param, half, None)
        with pytest.raises(ValueError, match=r"\(torch.float32\) does not match"):
            weight_loader_of(param)(param, torch.zeros(16, 768), None)
    finally:
        ps.set_tensor_parallel_for_testing(0, 1)
