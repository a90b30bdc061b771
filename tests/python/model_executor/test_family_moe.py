"""Mixtures of experts: tiny random Mixtral (top 2 of 4, renormalised), Qwen2-MoE (top 2 of 4,
not renormalised, a gated shared expert, a dense first layer) and Qwen3-MoE (top 3 of 8,
renormalised, per-head q/k norms) give transformers' logits from a Hugging Face folder and from
GGUF files as llama.cpp's converter writes them (merged expert stacks; F32, and Q8_0 / Q4_K
experts kept in their blocks, mapped from the file), through the one fused expert kernel, and
transformers' greedy tokens through the engine: whole prompts, chunked prefill, prefix caching,
preemption, and tensor parallelism over two ranks (the experts' intermediate dimension split,
one all-reduce per block)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from device_marks import requires_cuda
from family_parity import assert_family_parity, engine_greedy, hf_greedy, parity_prompts
from model_fixtures import PagedKVCache, save_tiny_gguf, save_tiny_model
from quant_fixtures import dequantized, quantized_rows
from vpage import ops
from vpage.model_executor import load_model
from vpage.model_executor.layers.fused_moe import FusedMoE
from vpage.model_executor.layers.linear import pack_dense_weights
from vpage.model_executor.models.moe import SparseMoeBlock

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _spread_routers(hf) -> None:
    """Router weights of real spread (transformers' init draws them with std 0.02): near ties
    between experts would let rounding pick other experts, which no tolerance covers."""
    gen = torch.Generator().manual_seed(11)
    for name, param in hf.named_parameters():
        if name.endswith("mlp.gate.weight"):
            param.data.copy_(torch.randn(param.shape, generator=gen) * 0.5)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(request.param, folder, seed=5)
    _spread_routers(hf)
    hf.save_pretrained(str(folder))
    return request.param, folder, hf


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def run_step(loaded, cache: PagedKVCache, chunks: dict[int, list[int]]) -> torch.Tensor:
    return loaded.model.compute_logits(loaded.model(cache.step(chunks), cache.caches))


def assert_logits_match(hf, loaded, rel=None):
    """A prompt in two chunks beside a second sequence, then decode steps: every row's logits
    are transformers' on the whole sequence, within 1e-4 or, given ``rel``, rel x the largest
    logit of the step."""

    def assert_close(ours, ref):
        atol = 1e-4 if rel is None else rel * ref.abs().max().item() + 1e-5
        torch.testing.assert_close(ours, ref, atol=atol, rtol=0)

    gen = torch.Generator().manual_seed(1)
    seqs = {0: torch.randint(3, 320, (29,), generator=gen).tolist(),
            1: torch.randint(3, 320, (11,), generator=gen).tolist()}
    cache = PagedKVCache(loaded.config, block_size=8)
    first = run_step(loaded, cache, {0: seqs[0][:13], 1: seqs[1]})
    ref = torch.cat([hf_logits(hf, seqs[0][:13]), hf_logits(hf, seqs[1])])
    assert ref.abs().max() > 0.1
    assert_close(first, ref)
    rest = run_step(loaded, cache, {0: seqs[0][13:]})
    assert_close(rest, hf_logits(hf, seqs[0])[13:])
    for _ in range(2):
        step = {s: [int(torch.randint(3, 320, (1,), generator=gen))] for s in seqs}
        for s, t in step.items():
            seqs[s] += t
        logits = run_step(loaded, cache, step)
        ref = torch.stack([hf_logits(hf, t)[-1] for t in seqs.values()])
        assert_close(logits, ref)


def moe_blocks(loaded) -> list[SparseMoeBlock]:
    return [m for m in loaded.model.modules() if isinstance(m, SparseMoeBlock)]


def test_hf_folder_matches_transformers(tiny):
    """The experts run in the fused kernel, packed like the dense weights."""
    kind, folder, hf = tiny
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    assert loaded.config.architecture == FAMILIES[kind]
    pack_dense_weights(loaded.model)
    blocks = moe_blocks(loaded)
    assert len(blocks) == (1 if kind == "qwen2_moe" else 2)  # Qwen2-MoE's layer 0 is dense
    assert all(isinstance(b.experts, FusedMoE) and b.experts.w1.packed is not None for b in blocks)
    assert (blocks[0].shared_expert is not None) == (kind == "qwen2_moe")
    # Qwen2-MoE's dense first layer: the C++ loop takes one MLP kind for every layer.
    assert loaded.model.has_cpu_decoder_structure() == (kind != "qwen2_moe")
    assert_logits_match(hf, loaded)


def test_gguf_f32_matches_transformers(tiny, tmp_path):
    """llama.cpp's layout: Mixtral as "llama" with experts (Q/K rows permuted), qwen2moe,
    qwen3moe; the dense layer of Qwen2-MoE found by its missing router."""
    kind, folder, hf = tiny
    path = tmp_path / f"{kind}.gguf"
    save_tiny_gguf(hf, folder, path)
    loaded = load_model(str(path), device="cpu")
    assert loaded.config.architecture == FAMILIES[kind] and loaded.config.dtype == torch.float32
    assert len(moe_blocks(loaded)) == (1 if kind == "qwen2_moe" else 2)
    assert_logits_match(hf, loaded)


def _mapped_file(address: int) -> str:
    """The file mapped at ``address`` in this process ("" for anonymous memory)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(v, 16) for v in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 else ""
    return ""


def _quantized_gguf(kind, qtype, tmp_path, **overrides):
    """A tiny model of ``kind`` with sizes of 256 (every row whole K blocks; ``overrides`` on
    top) saved as GGUF with its matrices in ``qtype`` (norms and routers F32); returns (path,
    hf model holding the dequantized weights)."""
    import gguf

    folder = tmp_path / kind
    sizes = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                 shared_expert_intermediate_size=256, head_dim=64)
    if kind == "mixtral":
        sizes = dict(hidden_size=256, intermediate_size=256)
    hf = save_tiny_model(kind, folder, seed=6, **sizes, **overrides)
    _spread_routers(hf)
    rng = np.random.default_rng(7)
    reference = {}

    def quantize(name, w):
        if w.ndim < 2 or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            return None
        rows = quantized_rows(qtype, w.reshape(-1, w.shape[-1]), rng)
        reference[name] = torch.from_numpy(dequantized(qtype, rows).astype(np.float32)).view(w.shape)
        return rows.reshape(*w.shape[:-1], -1), gguf.GGMLQuantizationType[qtype]

    path = tmp_path / f"{kind}-{qtype}.gguf"
    save_tiny_gguf(hf, folder, path, quantize)
    for name in [n for n in reference if n.endswith("experts.gate_proj.weight")]:
        stem = name.removesuffix("gate_proj.weight")
        reference[stem + "gate_up_proj"] = torch.cat([reference.pop(name), reference.pop(stem + "up_proj.weight")], 1)
        reference[stem + "down_proj"] = reference.pop(stem + "down_proj.weight")
    missing, unexpected = hf.load_state_dict(reference, strict=False)
    assert not unexpected and all("norm" in n or n.endswith(("gate.weight", "bias")) for n in missing)
    return path, hf


@pytest.mark.parametrize("kind,qtype", [("mixtral", "Q8_0"), ("qwen2_moe", "Q8_0"), ("qwen3_moe", "Q8_0"),
                                        ("qwen3_moe", "Q4_K")])
def test_quantized_gguf_experts_stay_in_blocks(kind, qtype, tmp_path):
    """The expert stacks stay in their blocks, views of the memory-mapped file, and the logits
    are transformers' on the same dequantized weights."""
    path, hf = _quantized_gguf(kind, qtype, tmp_path)
    loaded = load_model(str(path), device="cpu")
    for block in moe_blocks(loaded):
        for stack in (block.experts.w1, block.experts.w3, block.experts.w2):
            assert stack.qtype == qtype and _mapped_file(stack.qweight.data_ptr()) == str(path)
    # Both take integer paths (x and the activations rounded to 8 bits per 32 values, ~1% of an
    # expert's output): Q8_0 at any size, Q4_K up to 16 rows per expert (all of them here).
    assert_logits_match(hf, loaded, rel=2e-2)


@pytest.mark.slow
def test_quantized_experts_under_tensor_parallelism(tmp_path):
    """Q8_0 experts split over two ranks keep whole blocks (128 of 256 intermediate values
    each) and give the one-rank engine's greedy tokens."""
    path, _ = _quantized_gguf("qwen3_moe", "Q8_0", tmp_path)
    prompts = [list(range(3, 40)), list(range(50, 61))]
    one = engine_greedy(path, prompts, 8)
    assert engine_greedy(path, prompts, 8, tensor_parallel_size=2) == one


def test_the_experts_run_in_the_fused_kernel(tiny, monkeypatch):
    """Every MoE block's experts go through ops.fused_moe, once per block and step."""
    kind, folder, _ = tiny
    loaded = load_model(str(folder), dtype="float32", device="cpu")
    calls = []
    fused = ops.fused_moe
    monkeypatch.setattr(ops, "fused_moe", lambda *a, **k: calls.append(a[0].shape[0]) or fused(*a, **k))
    run_step(loaded, PagedKVCache(loaded.config, block_size=8), {0: list(range(3, 20))})
    assert calls == [17] * (1 if kind == "qwen2_moe" else 2)


@pytest.mark.parametrize("setting", ["plain", "chunked", "prefix", "preempt",
                                     pytest.param("tp2", marks=pytest.mark.slow)])
def test_engine_matches_transformers(tiny, setting):
    _, folder, hf = tiny
    assert_family_parity(folder, hf, [setting], prompt_len=37)


def test_checkpoint_names_map_onto_the_expert_stacks():
    from vpage.model_executor.models import get_model_class

    mixtral = get_model_class("MixtralForCausalLM").arch
    assert mixtral.param_for("model.layers.3.block_sparse_moe.experts.5.w3.weight") == (
        "model.layers.3.mlp.experts.w3.weight", 5)
    assert mixtral.param_for("model.layers.3.block_sparse_moe.gate.weight") == ("model.layers.3.mlp.gate.weight", None)
    qwen = get_model_class("Qwen2MoeForCausalLM").arch
    assert qwen.param_for("model.layers.0.mlp.experts.12.down_proj.weight") == (
        "model.layers.0.mlp.experts.w2.weight", 12)
    assert qwen.param_for("model.layers.0.mlp.shared_expert.up_proj.weight") == (
        "model.layers.0.mlp.shared_expert.gate_up_proj.weight", 1)
    assert qwen.param_for("model.layers.0.mlp.experts.w1.weight") == ("model.layers.0.mlp.experts.w1.weight", None)


def test_bfloat16_experts_follow_float32(tiny):
    """bfloat16 activations and packed bfloat16 experts: the float32 model's logits within
    bfloat16's rounding."""
    _, folder, _ = tiny
    logits = {}
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(str(folder), dtype=dtype, device="cpu")
        pack_dense_weights(loaded.model)
        logits[dtype] = run_step(loaded, PagedKVCache(loaded.config, block_size=8), {0: list(range(3, 30))})
    ref = logits["float32"]
    torch.testing.assert_close(logits["bfloat16"].float(), ref, atol=0.05 * ref.abs().max().item(), rtol=0)


def test_down_experts_whose_split_would_cut_blocks_stay_float_and_are_named():
    """Two ranks, Q4_K experts of 256 intermediate values: w1 and w3 keep whole rows (blocks),
    w2's 128 columns per rank would cut its 256-value blocks, so it is float, and the load's
    warning names it; Q8_0 (32-value blocks) keeps all three in blocks."""
    from vpage.distributed import parallel_state as ps
    from vpage.model_executor.layers.quantization import GgufQuantConfig

    for qtype, type_id in (("Q4_K", 12), ("Q8_0", 8)):
        quant = GgufQuantConfig({f"model.layers.0.mlp.experts.w{i}": {type_id} for i in (1, 2, 3)})
        ps.set_tensor_parallel_for_testing(1, 2)
        try:
            experts = FusedMoE(4, 2, 256, 256, True, torch.float32, quant, "model.layers.0.mlp.experts")
        finally:
            ps.set_tensor_parallel_for_testing(0, 1)
        assert experts.w1.qtype == experts.w3.qtype == qtype and experts.w1.rows == 128
        if qtype == "Q4_K":
            assert experts.w2.qtype is None and experts.w2.weight.shape == (4, 256, 128)
            assert "mlp.experts.w2 (1 layer: 256 input columns in Q4_K blocks" in quant.cut_blocks_message()
        else:
            assert experts.w2.qtype == "Q8_0" and quant.cut_blocks_message() is None


def _loop_and_layers(loaded, steps):
    """Hidden states and KV caches of ``steps`` (lists of {seq: tokens}) through the C++ loop
    and through the Python layers, each from fresh caches of the same blocks."""
    results = []
    for use_loop in (True, False):
        loaded.model.use_cpu_decoder = use_loop
        cache = PagedKVCache(loaded.config, block_size=8)
        hidden = [loaded.model(cache.step(chunks), cache.caches) for chunks in steps]
        results.append((hidden, [t.clone() for kv in cache.caches for t in kv]))
        if use_loop:
            assert loaded.model._cpu_decoder[1] is not None, "the C++ loop was not built"
    loaded.model.use_cpu_decoder = True
    return results


@pytest.mark.parametrize("kind", sorted(FAMILIES))
@pytest.mark.parametrize("source", ["folder", "bfloat16", "Q8_0"])
def test_cpu_loop_runs_the_moe_blocks_bitwise_like_the_layers(kind, source, tmp_path):
    """On the C++ layer loop (router, fused experts, Qwen2-MoE's gated shared expert) every
    family gives bitwise the Python layers' hidden states and caches: packed float32 or
    bfloat16 weights, or GGUF blocks (Qwen2-MoE without its dense layer here)."""
    every_layer_sparse = dict(mlp_only_layers=[]) if kind == "qwen2_moe" else {}
    if source == "Q8_0":
        path, _ = _quantized_gguf(kind, "Q8_0", tmp_path, **every_layer_sparse)
        loaded = load_model(str(path), device="cpu")
    else:
        hf = save_tiny_model(kind, tmp_path, seed=5, **every_layer_sparse)
        _spread_routers(hf)
        hf.save_pretrained(str(tmp_path))
        loaded = load_model(str(tmp_path), dtype="float32" if source == "folder" else source, device="cpu")
    pack_dense_weights(loaded.model)
    assert loaded.model.has_cpu_decoder_structure()
    steps = [{0: list(range(3, 24)), 1: list(range(40, 49))}, {0: [5], 1: [6]}, {0: [7], 1: [8]}]
    (loop_hidden, loop_caches), (layer_hidden, layer_caches) = _loop_and_layers(loaded, steps)
    for ours, ref in zip(loop_hidden + loop_caches, layer_hidden + layer_caches):
        assert torch.equal(ours, ref)


@requires_cuda
def test_engine_on_cuda_matches_transformers(tiny):
    """The experts in vpage's grouped CUDA kernel (decode steps in CUDA graphs)."""
    _, folder, hf = tiny
    prompts = parity_prompts(hf.config, hf, 37, 16)[:3]
    assert engine_greedy(folder, prompts, 16, device="cuda") == [hf_greedy(hf, p, 16) for p in prompts]


def test_tensor_parallel_check_covers_the_experts(tmp_path):
    """The engine refuses a tensor-parallel size that cannot split the experts before any
    worker starts."""
    from model_fixtures import tiny_hf_config
    from vpage.model_executor import inspect_model

    tiny_hf_config("qwen3_moe", moe_intermediate_size=50).save_pretrained(str(tmp_path))
    facts = inspect_model(str(tmp_path))
    facts.check_tensor_parallel(2)
    with pytest.raises(ValueError, match="does not divide the experts' moe_intermediate_size 50"):
        facts.check_tensor_parallel(4)


def test_a_checkpoint_with_an_unknown_expert_is_a_clear_error(tiny, tmp_path):
    from vpage.model_executor.models import get_model_class

    kind, _, hf = tiny
    model = get_model_class(FAMILIES[kind])(hf.config, torch.float32)
    name = ("model.layers.1.block_sparse_moe.experts.9.w1.weight" if kind == "mixtral"
            else "model.layers.1.mlp.experts.9.gate_proj.weight")
    with pytest.raises(ValueError, match=r"experts\.9\.\S+ is expert 9 of a model with \d experts"):
        model.load_weights([(name, torch.zeros(1))])
