"""A float16 or bfloat16 KV cache under float32 activations on CPU (``kv_cache_dtype``): the
kernels round K/V once when writing them and read them back exactly, against the float64
reference on the rounded cache; the engine holds twice the tokens in the same memory and
its greedy outputs leave the float32 cache's only at near-ties; mismatched dtypes are refused
with a clear error."""

from __future__ import annotations

import math

import pytest
import torch

from default_model_prompts import PROMPTS
from device_marks import available_isas
from kv_reference import make_block_tables, reference_paged_attention, reference_prefill_attention
from vpage import LLM, SamplingParams, _core, ops
from vpage.engine.arg_utils import EngineArgs

CACHE_DTYPES = [torch.float16, torch.bfloat16]


def _written_cache(cache_dtype, contexts, num_kv_heads, head_size, block_size, seed):
    """Caches of ``cache_dtype`` filled through reshape_and_cache from float32 rows (NaN in
    every slot no context covers), their block tables, and the float32 rows."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(n / block_size) for n in contexts) + 3
    shape = (num_blocks, num_kv_heads, head_size, block_size, cache_dtype)
    kc = torch.full(ops.key_cache_shape(*shape), float("nan"), dtype=cache_dtype)
    vc = torch.full(ops.value_cache_shape(*shape), float("nan"), dtype=cache_dtype)
    tables = make_block_tables(contexts, block_size, num_blocks, generator=gen)
    slots = torch.tensor([int(tables[s, t // block_size]) * block_size + t % block_size
                          for s, n in enumerate(contexts) for t in range(n)], dtype=torch.int64)
    rows = torch.randn((len(slots), 3, num_kv_heads, head_size), generator=gen)
    key, value = rows[:, 1], rows[:, 2]  # strided, as sliced from a fused projection
    ops.reshape_and_cache(key, value, kc, vc, slots)
    return kc, vc, tables, key, value, slots


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_float32_rows_are_rounded_into_the_cache_as_torch_rounds_them(cache_dtype):
    kc, vc, _, key, value, slots = _written_cache(cache_dtype, [5, 19], 2, 64, 8, seed=1)
    for t, slot in enumerate(slots.tolist()):
        b, o = divmod(slot, 8)
        assert torch.equal(kc[b, :, :, o, :].reshape(2, 64), key[t].to(cache_dtype))
        assert torch.equal(vc[b, :, :, o], value[t].to(cache_dtype))


@pytest.mark.parametrize("isa", available_isas())
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("block_size,group", [(16, 3), (8, 1), (32, 8)])
def test_float32_attention_over_a_16_bit_cache(isa, cache_dtype, block_size, group):
    contexts = [1, 17, 54, 300]
    num_kv_heads = 2 if group < 8 else 1
    kc, vc, tables, _, _, _ = _written_cache(cache_dtype, contexts, num_kv_heads, 64, block_size, seed=2)
    lens = torch.tensor(contexts, dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    heads = group * num_kv_heads
    _core.set_cpu_isa(isa)
    try:
        query = torch.rand((len(contexts), heads, 64), generator=gen) * 2 - 1
        out = ops.paged_attention(query, kc, vc, tables, lens, 0.125)
        ref = reference_paged_attention(query, kc, vc, tables, lens, 0.125)
        assert out.dtype == torch.float32 and (out.double() - ref).abs().max() < 2e-5

        num_queries = [1, 17, 20, 7]  # whole prompts, a chunk after a cached prefix, a decode token
        starts = torch.tensor([0] + list(torch.tensor(num_queries).cumsum(0)), dtype=torch.int32)
        query = torch.rand((sum(num_queries), heads, 64), generator=gen) * 2 - 1
        out = ops.paged_prefill_attention(query, kc, vc, tables, starts, lens, 0.125)
        ref = reference_prefill_attention(query, kc, vc, tables, starts, lens, 0.125)
        assert out.dtype == torch.float32 and (out.double() - ref).abs().max() < 2e-5
    finally:
        _core.set_cpu_isa("auto")


def test_mismatched_dtypes_are_refused():
    kc, vc, tables, key, value, slots = _written_cache(torch.float16, [9], 1, 64, 8, seed=4)
    lens = torch.tensor([9], dtype=torch.int32)
    with pytest.raises(TypeError, match="query must have the cache's dtype or float32"):
        ops.paged_attention(torch.zeros(1, 2, 64, dtype=torch.bfloat16), kc, vc, tables, lens, 0.125)
    with pytest.raises(TypeError, match="one dtype"):
        ops.reshape_and_cache(key, value.half(), kc, vc, slots)
    f32 = [torch.zeros(ops.key_cache_shape(2, 1, 64, 8, torch.float32)),
           torch.zeros(ops.value_cache_shape(2, 1, 64, 8, torch.float32))]
    with pytest.raises(TypeError, match="key must have the cache's dtype"):
        ops.reshape_and_cache(key[:2].half(), value[:2].half(), *f32, slots[:2] % 16)
    assert not ops.kv_dtypes_supported(torch.float32, torch.float16, torch.device("cuda"))
    assert ops.kv_dtypes_supported(torch.float32, torch.bfloat16, torch.device("cpu"))


_ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory=0.25, swap_space=0.0, max_model_len=512,
               max_num_batched_tokens=512)
NEAR_TIE = 0.5  # as in test_quant_engine.py: the integer matmuls' 8-bit inputs make ties wide


@pytest.fixture(scope="module")
def float32_cache():
    return LLM(**_ENGINE)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_engine_with_a_16_bit_cache(float32_cache, kv_cache_dtype):
    llm = LLM(kv_cache_dtype=kv_cache_dtype, **_ENGINE)
    try:
        key, _ = llm.engine.executor.driver_worker.cache_engine.gpu_cache[0]
        assert key.dtype == getattr(torch, kv_cache_dtype)
        assert llm.engine.num_gpu_blocks == 2 * float32_cache.engine.num_gpu_blocks
        params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5)
        ours = llm.generate(PROMPTS, params, use_tqdm=False)
        reference = float32_cache.generate(PROMPTS, params, use_tqdm=False)
        equal = 0
        for prompt, o, r in zip(PROMPTS, ours, reference):
            a, b = o.outputs[0].token_ids, r.outputs[0].token_ids
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if i is None:
                equal += 1
                continue
            top = r.outputs[0].logprobs[i]  # diverged only where the float32 cache's best two were close
            assert a[i] in top and max(lp.logprob for lp in top.values()) - top[a[i]].logprob < NEAR_TIE, (prompt, i)
        assert equal >= 3
    finally:
        llm.shutdown()


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="cannot hold the KV cache of torch.bfloat16 activations"):
        LLM(dtype="bfloat16", kv_cache_dtype="float16", device="cpu", kv_cache_memory=0.25, max_model_len=512)


def test_cli_flag(capsys):
    from vpage.cli import main as cli_main

    engine = ["--kv-cache-memory", "0.25", "--device", "cpu", "--dtype", "float32"]
    assert cli_main(["generate", "The capital of France is", "--no-chat-template", "--max-tokens", "6",
                     "--kv-cache-dtype", "float16", *engine]) == 0
    streamed = capsys.readouterr().out
    llm = LLM(kv_cache_dtype="float16", kv_cache_memory=0.25, device="cpu", dtype="float32")
    try:
        expected = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=6),
                                use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()
    assert expected.strip() and streamed.rstrip("\n") == expected
    assert cli_main(["generate", "x", "--kv-cache-dtype", "float16", "--dtype", "bfloat16", "--device", "cpu"]) == 2
    assert "cannot hold the KV cache" in capsys.readouterr().err
