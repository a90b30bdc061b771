"""Pipeline parallelism on tiny random models, on CPU (gloo): greedy outputs with pp = 2 (two
interleaved layer ranges per stage), pp = 3 (one) and pp = 2 x tp = 2 equal one rank's (Llama, Gemma 2's own forward, a GGUF file kept quantized),
with micro-batched steps, chunked prefill, preemption by swap and by recompute, prefix caching,
parallel sampling and beams; each stage holds only its layers' weights and KV cache. The
micro-batch cuts and the layer split are checked alone, and configurations that cannot run
pipelined fail before any process starts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from bounded_loops import run_requests
from model_fixtures import save_tiny_gguf, save_tiny_model, save_tiny_tokenizer
from test_tensor_parallel import BS, FEATURES, PROMPTS, children, greedy, run
from vpage import EngineArgs, LLMEngine, SamplingParams
from vpage.model_executor.pipeline_layers import pipeline_layers
from vpage.worker.pipeline import micro_batches

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    llama = tmp_path_factory.mktemp("llama")
    hf = save_tiny_model("llama", llama, seed=3, vocab_size=321, num_hidden_layers=5)
    out["llama"] = llama
    gemma = tmp_path_factory.mktemp("gemma2")  # windowed and global layers, soft-caps, tied embeddings
    config = transformers.Gemma2Config(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       max_position_embeddings=256, sliding_window=16, query_pre_attn_scalar=20,
                                       attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                       initializer_range=0.15, tie_word_embeddings=True)
    torch.manual_seed(3)
    transformers.Gemma2ForCausalLM(config).save_pretrained(gemma)
    save_tiny_tokenizer(gemma)
    out["gemma2"] = gemma
    out["gguf"] = llama / "model-q8.gguf"
    save_tiny_gguf(hf, llama, out["gguf"], lambda name, w: None if w.ndim != 2 else (_q8(w), _Q8_0()))
    return out


def _Q8_0():
    import gguf

    return gguf.GGMLQuantizationType.Q8_0


def _q8(w):
    from quant_fixtures import quantized_rows

    return quantized_rows("Q8_0", w, np.random.default_rng(0))


def engine(model, pp: int = 1, tp: int = 1, **kwargs) -> LLMEngine:
    args = dict(model=str(model), dtype="float32", kv_cache_memory=0.01, block_size=BS, num_threads=pp * tp,
                pipeline_parallel_size=pp, tensor_parallel_size=tp)
    args.update(kwargs)
    return LLMEngine(EngineArgs(**args))


def outputs(model, requests, pp: int = 1, tp: int = 1, **kwargs):
    e = engine(model, pp, tp, **kwargs)
    try:
        return run(e, requests), e.get_stats()
    finally:
        e.shutdown()


def test_micro_batches_cut_sequences_into_equal_token_shares():
    decode = np.arange(17, dtype=np.int32)  # 16 one-token rows
    assert micro_batches(decode, 4) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert micro_batches(decode, 1) == [(0, 16)]
    assert micro_batches(np.array([0, 1], dtype=np.int32), 4) == [(0, 1)]
    # A long prefill chunk stays whole: its range holds it alone, the others share the rest.
    mixed = np.cumsum([0, 1, 1, 100, 1, 1, 1], dtype=np.int32)
    ranges = micro_batches(mixed, 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == 6 and all(a < b for a, b in ranges)
    assert all(r[1] == s[0] for r, s in zip(ranges, ranges[1:]))
    assert any(a <= 2 < b and b - a == 1 for a, b in ranges)


def test_layer_split_balances_the_output_projection(monkeypatch):
    smollm = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
    # Two interleaved ranges per stage; the head reads as many weights as 8 layers.
    assert pipeline_layers(smollm, 2) == (10, 9, 9, 2)
    assert sum(pipeline_layers(smollm, 3)) == 30 and len(pipeline_layers(smollm, 3)) == 6
    monkeypatch.setenv("VPAGE_PP_VIRTUAL_STAGES", "1")
    assert pipeline_layers(smollm, 2) == (19, 11)
    monkeypatch.setenv("VPAGE_PP_LAYER_PARTITION", "15,15")
    assert pipeline_layers(smollm, 2) == (15, 15)
    monkeypatch.setenv("VPAGE_PP_LAYER_PARTITION", "8,7,8,7")
    assert pipeline_layers(smollm, 2) == (8, 7, 8, 7)
    for bad in ("15,14", "30,0", "a,b", "10,10,10"):
        monkeypatch.setenv("VPAGE_PP_LAYER_PARTITION", bad)
        with pytest.raises(ValueError, match="VPAGE_PP_LAYER_PARTITION"):
            pipeline_layers(smollm, 2)
    monkeypatch.delenv("VPAGE_PP_LAYER_PARTITION")
    with pytest.raises(ValueError, match="exceeds the model's 30 decoder layers"):
        pipeline_layers(smollm, 31)


@pytest.mark.parametrize("pp, tp, micro", [(2, 1, "4"), (3, 1, "2"), (2, 2, "3")])
def test_greedy_matches_one_rank(folders, monkeypatch, pp, tp, micro):
    monkeypatch.setenv("VPAGE_PP_MICROBATCHES", micro)  # the spawned workers inherit it
    rng = np.random.default_rng(1)  # up to 96 decode rows a step: 3 micro-batches of 32 tokens
    requests = [(p, greedy(12)) for p in PROMPTS] + [(rng.integers(3, 300, 3).tolist(), greedy(6))
                                                       for _ in range(95)]
    expected, _ = outputs(folders["llama"], requests)
    e = engine(folders["llama"], pp, tp, max_num_batched_tokens=96)  # chunked prefills
    try:
        got = run(e, requests)
        assert e.executor.driver_worker.model_runner.pipeline.num_split_steps > 5
    finally:
        e.shutdown()
    assert got == expected
    assert not children()


def test_stages_hold_only_their_layers(folders):
    e = engine(folders["llama"], 2, max_num_batched_tokens=32)
    try:
        worker = e.executor.driver_worker
        assert e.config.parallel.pipeline_layers == (2, 1, 1, 1)  # stage 0: layers 0, 1 and 3
        names = {n for n, _ in worker.loaded.model.named_parameters()}
        assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {"0", "1", "3"}
        assert "lm_head.weight" not in names and "model.norm.weight" not in names
        assert len(worker.cache_engine.gpu_cache) == 3
    finally:
        e.shutdown()


@pytest.mark.parametrize("mode, budget", [("swap", 2048), ("recompute", 16)])
def test_preemption_sampling_and_beams_match_one_rank(folders, mode, budget):
    layer_bytes = 2 * 2 * 16 * BS * 4  # of one block: keys and values of 2 KV heads of 16
    kwargs = dict(kv_cache_memory=14 * 5 * layer_bytes / 2**30, swap_space=64 * 5 * layer_bytes / 2**30,
                  preemption_mode=mode, max_model_len=96, enable_prefix_caching=True, max_num_batched_tokens=budget)
    expected, _ = outputs(folders["llama"], FEATURES, **kwargs)
    # The same 14 blocks on the larger stage (3 of the 5 layers; the smaller one has more).
    stage = dict(kwargs, kv_cache_memory=14 * 3 * layer_bytes / 2**30, swap_space=64 * 3 * layer_bytes / 2**30)
    e = engine(folders["llama"], 2, **stage)
    try:
        assert e.scheduler.usage().num_gpu_blocks == 14
        got, stats = run(e, FEATURES), e.get_stats()
    finally:
        e.shutdown()
    assert got == expected
    assert (stats.num_preempted_swap if mode == "swap" else stats.num_preempted_recompute) > 0
    assert not children()


@pytest.mark.parametrize("model", ["gemma2", "gguf"])
def test_other_forwards_and_quantized_stages_match_one_rank(folders, model):
    requests = [(p, greedy(10)) for p in PROMPTS] + [
        (list(range(10, 53)), SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8, ignore_eos=True))]
    expected, _ = outputs(folders[model], requests)
    got, _ = outputs(folders[model], requests, 2)
    assert got == expected


@pytest.mark.parametrize("kwargs, match", [
    (dict(pipeline_parallel_size=6), "exceeds the model's 5 decoder layers"),
    (dict(pipeline_parallel_size=2, enable_lora=True), "LoRA adapters do not run under pipeline"),
    (dict(pipeline_parallel_size=2, runner="pooling"), "pipeline_parallel_size applies to generation"),
    (dict(pipeline_parallel_size=2, speculative_config={"model": "x", "num_speculative_tokens": 2}),
     "draft model does not run under pipeline"),
    (dict(pipeline_parallel_size=2, kv_offloading_size=0.01, kv_offloading_disk_path="x"), "runs on one rank"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be an integer >= 1"),
])
def test_bad_configurations_fail_before_starting(folders, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(folders["llama"]), **kwargs).create_engine_config()
    assert not children()


def test_ngram_speculation_and_prompt_logprobs_match_one_rank(folders):
    """Steps whose logits carry draft rows or prompt rows run as one micro-batch."""
    looped = [list(range(20, 40)) * 3, [7, 8, 9] * 10]
    requests = [(p, greedy(16)) for p in looped] + [
        (PROMPTS[2], SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2, ignore_eos=True))]
    expected, _ = outputs(folders["llama"], requests)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    e = engine(folders["llama"], 2, speculative_config=spec)
    try:
        got = run_requests(e, requests)
        assert e.get_stats().spec_decode_num_draft_tokens > 0
    finally:
        e.shutdown()
    assert [[c.token_ids for c in out.outputs] for out in got] == expected
    one = engine(folders["llama"])
    try:
        ref = run_requests(one, requests[-1:])[0].prompt_logprobs
    finally:
        one.shutdown()
    assert [None if d is None else {t: round(v.logprob, 5) for t, v in d.items()} for d in got[-1].prompt_logprobs] \
        == [None if d is None else {t: round(v.logprob, 5) for t, v in d.items()} for d in ref]
