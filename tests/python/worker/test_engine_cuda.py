"""The engine's CUDA path: decode CUDA graphs, pinned input staging, swaps on the cache
stream, memory profiling.

The device-agnostic pieces (graph buckets, padding, staging growth, the cache engine's CPU
behaviour, the flags) run everywhere; the engine tests marked ``cuda`` need a GPU and
vpage._cuda. They compare greedy outputs in float32 (graphs on/off, swap preemption/none,
CUDA/CPU) on the default model, and bfloat16 on CUDA with float32 on the CPU up to near-ties.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from default_model_prompts import PROMPTS
from device_marks import requires_cuda
from vpage.worker.cache_engine import CacheEngine, bytes_per_block
from vpage.worker.graph_buckets import (MAX_GRAPH_BATCH, fill_padded_decode, graph_batch_for, graph_batch_sizes,
                                        padded_batch_size)
from vpage.worker.input_staging import StagingBuffer, StepInputs
from vpage.model_executor.config import ModelConfig


# ------------------------------------------------------------------ device-agnostic parts


def test_graph_batch_sizes():
    assert graph_batch_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(100_000)[-1] == MAX_GRAPH_BATCH
    for n in (1, 5, 64, 99, 300):
        sizes = graph_batch_sizes(n)
        assert sizes == sorted(set(sizes)) and sizes[-1] == min(n, MAX_GRAPH_BATCH)


def test_padded_batch_size_and_eligibility():
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 64)] == [1, 2, 4, 8, 8, 16, 24, 64]
    assert padded_batch_size(65, sizes) is None
    ok = dict(sizes=sizes, max_graph_context=1024, max_graph_blocks=64)
    assert graph_batch_for(7, 1, 1024, 64, **ok) == 8
    assert graph_batch_for(0, 1, 10, 1, **ok) is None  # nothing to run
    assert graph_batch_for(7, 2, 10, 1, **ok) is None  # prefill or mixed step
    assert graph_batch_for(7, 1, 1025, 64, **ok) is None  # context longer than captured
    assert graph_batch_for(7, 1, 1000, 65, **ok) is None  # block table wider than captured
    assert graph_batch_for(65, 1, 10, 1, **ok) is None  # above the largest bucket


def _graph_host(rows: int, width: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.full(rows, 99, np.int64), "positions": np.full(rows, 99, np.int64),
            "slot_mapping": np.full(rows, 99, np.int64), "context_lens": np.full(rows, 99, np.int32),
            "block_tables": np.full((rows, width), 77, np.int32)}


def test_fill_padded_decode_pads_rows_to_the_scratch_block():
    host = _graph_host(16, 6)
    tables = np.array([[-1, 4], [5, 6], [-1, 8]], np.int32)  # -1: freed before a sliding window
    fill_padded_decode(host, np.array([10, 11, 12]), np.array([20, 21, 22]), np.array([30, 31, -1]),
                       np.array([21, 22, 23], np.int32), tables, batch=4, scratch_block=9)
    assert host["input_ids"][:5].tolist() == [10, 11, 12, 0, 99]
    assert host["positions"][:5].tolist() == [20, 21, 22, 0, 99]
    assert host["slot_mapping"][:5].tolist() == [30, 31, -1, -1, 99]  # padding writes nothing
    assert host["context_lens"][:5].tolist() == [21, 22, 23, 1, 99]  # and reads one scratch token
    assert host["block_tables"][:3, :2].tolist() == tables.tolist()
    assert host["block_tables"][3, 0] == 9
    assert (host["block_tables"][:3, 2:] == 77).all()  # stale columns past the tables stay (never read)
    with pytest.raises(ValueError, match="does not fit"):
        fill_padded_decode(host, np.zeros(5), np.zeros(5), np.zeros(5), np.ones(5, np.int32),
                           np.zeros((5, 2), np.int32), batch=4, scratch_block=9)
    with pytest.raises(ValueError, match="does not fit"):
        fill_padded_decode(host, np.zeros(1), np.zeros(1), np.zeros(1), np.ones(1, np.int32),
                           np.zeros((1, 7), np.int32), batch=1, scratch_block=9)


def test_staging_buffer_reuses_and_grows_on_cpu():
    buf = StagingBuffer(torch.int32, torch.device("cpu"), capacity=4, pin=False)
    host = buf.host
    small = np.arange(6, dtype=np.int32).reshape(2, 3)[:, :2].copy()
    out = buf.upload(small)
    assert out.shape == (2, 2) and out.tolist() == small.tolist() and buf.host is host  # reused
    big = np.arange(5, dtype=np.int32)
    assert buf.upload(big).tolist() == big.tolist() and buf.capacity == 8  # doubled
    huge = np.arange(21, dtype=np.int32)
    assert buf.upload(huge).tolist() == huge.tolist() and buf.capacity == 21
    assert buf.upload(np.zeros(0, np.int32)).shape == (0,)


def test_step_inputs_on_cpu():
    plan = SimpleNamespace(input_ids=np.array([1, 2, 3]), positions=np.array([0, 1, 2]),
                           slot_mapping=np.array([4, 5, 6]), block_tables=np.array([[-1, 2], [3, 4]], np.int32),
                           context_lens=np.array([2, 1], np.int32), query_start_loc=np.array([0, 2, 3], np.int32),
                           sample_token_indices=np.array([1, 2]))
    staging = StepInputs(torch.device("cpu"), max_tokens=2, max_seqs=1, max_blocks=1, pin=False)
    for _ in range(2):
        inputs = staging.upload(plan)
        for name, tensor in inputs.items():
            assert tensor.tolist() == getattr(plan, name).tolist(), name
    assert inputs["block_tables"].dtype == torch.int32 and inputs["input_ids"].dtype == torch.int64
    assert list(staging.upload(plan, ["sample_token_indices"])) == ["sample_token_indices"]


def _tiny_config() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", num_layers=3, num_heads=4, num_kv_heads=2, head_size=64,
                       hidden_size=256, vocab_size=100, max_model_len=64, dtype=torch.float32)


def test_cpu_cache_engine_swaps_synchronously_without_events():
    cache = CacheEngine(_tiny_config(), 8, num_gpu_blocks=4, num_cpu_blocks=4, device=torch.device("cpu"),
                        scratch_blocks=1)
    assert cache.scratch_block == 4 and cache.gpu_cache[0][0].shape[0] == 5
    assert all(float(k[4].abs().sum()) == 0 and float(v[4].abs().sum()) == 0 for k, v in cache.gpu_cache)
    for key, value in cache.gpu_cache:
        key[:4].normal_()
        value[:4].normal_()
    for key, value in cache.cpu_cache:  # never compare uninitialised memory (it may hold NaNs)
        key.normal_()
        value.normal_()
    before = [(k.clone(), v.clone()) for k, v in cache.gpu_cache]
    # Device block 1 goes out to swap block 2 and, in the same step, swap block 0 comes in there.
    cache.cpu_cache[0][0][0].fill_(7.0)
    cache.swap(np.array([[1, 2]]), np.array([[0, 1]]))
    assert cache.take_layer_events() is None  # no streams or events on CPU
    cache.wait_for_swaps()
    for (k0, v0), (ck, cv), (k, v) in zip(before, cache.cpu_cache, cache.gpu_cache):
        assert torch.equal(ck[2], k0[1]) and torch.equal(cv[2], v0[1])
        assert torch.equal(k[1], ck[0]) and torch.equal(v[1], cv[0])
    assert bool((cache.gpu_cache[0][0][1] == 7.0).all())


def test_model_layers_know_their_index(tmp_path):
    from model_fixtures import save_tiny_model
    from vpage.model_executor.loader.model_loader import load_model

    save_tiny_model("llama", tmp_path)
    model = load_model(str(tmp_path), "float32", "cpu").model
    assert [layer.self_attn.attn.layer_index for layer in model.model.layers] == list(range(len(model.model.layers)))


def test_cli_flags_reach_engine_args():
    from vpage.cli import _parser

    for command in (["generate", "hi"], ["chat"], ["serve"]):
        args = _parser().parse_args(command + ["--enforce-eager", "--gpu-memory-utilization", "0.5"])
        assert args.enforce_eager and args.gpu_memory_utilization == 0.5
        assert not _parser().parse_args(command).enforce_eager


# ------------------------------------------------------------------------------- on a GPU


def _free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _greedy(llm, prompts=PROMPTS, max_tokens: int = 48) -> list[list[int]]:
    from vpage import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _llm(**kwargs):
    from vpage import LLM

    args = dict(dtype="float32", quantization="none", device="cuda", kv_cache_memory=1.0, swap_space=0.25,
                max_num_batched_tokens=512, max_num_seqs=16)
    args.update(kwargs)
    return LLM(**args)


@requires_cuda
def test_cuda_graphs_match_eager_and_are_replayed():
    eager = _llm(enforce_eager=True)
    assert eager.engine.executor.driver_worker.model_runner.graphs is None
    expected, expected_three = _greedy(eager), _greedy(eager, PROMPTS[:3])
    del eager
    _free_cuda()
    graphed = _llm()
    runner = graphed.engine.executor.driver_worker.model_runner
    assert runner.graphs is not None and runner.graphs.sizes == graph_batch_sizes(16)
    assert runner.staging.buffers["input_ids"].host.is_pinned()
    replays = []
    runner.graphs.run = lambda plan, rows, run=runner.graphs.run: replays.append(rows) or run(plan, rows)
    assert _greedy(graphed) == expected
    assert 8 in replays  # the 8-row decode steps (and fewer rows, padded up, once requests end)
    assert _greedy(graphed, PROMPTS[:3]) == expected_three  # 3 rows padded to 4
    assert 4 in replays
    del graphed, runner
    _free_cuda()


@requires_cuda
def test_cuda_swap_preemption_matches_no_preemption():
    roomy = _llm()
    expected = _greedy(roomy)
    block_bytes = bytes_per_block(roomy.engine.executor.driver_worker.cache_config, 16)
    del roomy
    _free_cuda()
    tight = _llm(kv_cache_memory=20 * block_bytes / 2**30, max_model_len=256, preemption_mode="swap")
    assert _greedy(tight) == expected
    assert tight.engine.get_stats().num_preempted_swap > 0
    usage = tight.engine.scheduler.usage()
    assert usage.free_gpu_blocks == usage.num_gpu_blocks
    del tight
    _free_cuda()


@requires_cuda
def test_cuda_float32_matches_cpu_engine():
    from vpage import LLM

    cpu = LLM(dtype="float32", quantization="none", device="cpu", kv_cache_memory=1.0, max_num_batched_tokens=512)
    expected = _greedy(cpu)
    del cpu
    assert _greedy(_llm()) == expected
    _free_cuda()


# bfloat16 rounds every activation to 8 significant bits: outputs may leave the float32 ones,
# but only where the float32 path's two best tokens are near-tied (the bound the quantized
# tests use); a wrong kernel moves logprobs by whole units.
NEAR_TIE = 0.5


@requires_cuda
def test_cuda_bfloat16_matches_cpu_float32_except_near_ties():
    from vpage import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5)
    cpu = LLM(dtype="float32", quantization="none", device="cpu", kv_cache_memory=1.0, max_num_batched_tokens=512)
    reference = cpu.generate(PROMPTS, params, use_tqdm=False)
    del cpu
    ours = _llm(dtype="bfloat16").generate(PROMPTS, params, use_tqdm=False)
    drift = []
    for prompt, o, f in zip(PROMPTS, ours, reference):
        a, b = o.outputs[0].token_ids, f.outputs[0].token_ids
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        drift += [abs(lo[t].logprob - lf[t].logprob)
                  for lo, lf, t in zip(o.outputs[0].logprobs[:i], f.outputs[0].logprobs[:i], a[:i])]
        if i < len(a):
            top = f.outputs[0].logprobs[i]
            assert a[i] in top, (prompt, i)
            assert max(lp.logprob for lp in top.values()) - top[a[i]].logprob < NEAR_TIE, (prompt, i)
    assert drift and sorted(drift)[len(drift) // 2] < 0.1 and max(drift) < NEAR_TIE
    _free_cuda()


@requires_cuda
def test_memory_profiling_sizes_the_cache_and_names_the_knobs():
    _free_cuda()
    llm = _llm(kv_cache_memory=None, gpu_memory_utilization=0.5)
    cache = llm.engine.executor.driver_worker.cache_engine
    total = torch.cuda.get_device_properties(0).total_memory
    assert cache.num_gpu_blocks > 0
    assert cache.num_gpu_blocks * bytes_per_block(llm.engine.executor.driver_worker.cache_config, 16) <= 0.5 * total
    assert _greedy(llm, PROMPTS[:2], 8)
    weights = sum(p.numel() * p.element_size() for p in llm.engine.executor.driver_worker.loaded.model.parameters())
    del llm, cache
    _free_cuda()
    tiny = weights / 4 / total  # a quarter of the weights alone
    with pytest.raises(ValueError, match="gpu_memory_utilization") as error:
        _llm(kv_cache_memory=None, gpu_memory_utilization=tiny)
    for knob in ("max_num_batched_tokens", "max_model_len", "dtype", "tensor_parallel_size"):
        assert knob in str(error.value)
    _free_cuda()


@requires_cuda
def test_cuda_speculative_decoding_matches_plain_decoding():
    # Draft rows run eagerly, each token its own decode query; the output is plain decoding's.
    plain = _llm()
    expected = _greedy(plain)
    del plain
    _free_cuda()
    for spec in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
                 {"model": "smollm2", "num_speculative_tokens": 3}):
        llm = _llm(speculative_config=spec)
        assert _greedy(llm) == expected, spec
        stats = llm.engine.get_stats()
        assert stats.spec_decode_num_draft_tokens > 0, spec
        del llm
        _free_cuda()
