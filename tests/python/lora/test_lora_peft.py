"""Multi-LoRA against PEFT: three adapters of different ranks and target modules (one rsLoRA, one
with a rank_pattern) on a tiny random Llama, in mixed batches with base-model requests, give
PEFT's greedy tokens; with chunked prefill, preemption, an adapter LRU smaller than the adapters,
and prefix-cache hits kept apart per adapter. Bad adapters are clear errors that change nothing."""

from __future__ import annotations

import json
import shutil

import pytest

from lora_fixtures import MAX_TOKENS, PROMPTS, make_lora_setup
from vpage import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """(base folder, {name: adapter folder}, {None or name: [greedy tokens per prompt]})."""
    return make_lora_setup(tmp_path_factory.mktemp("lora"))


def _requests(folders: dict[str, str]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(folders.items())}


def _mixed(llm: LLM, loras: dict[str, LoRARequest], expected: dict) -> None:
    cases = [(p, name) for name in [None, *loras] for p in range(len(PROMPTS))]
    outs = llm.generate([PROMPTS[p] for p, _ in cases], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                         ignore_eos=True),
                        use_tqdm=False, lora_request=[loras[n] if n else None for _, n in cases])
    got = {(p, n): list(o.outputs[0].token_ids) for (p, n), o in zip(cases, outs)}
    assert [o.lora_request for o in outs] == [loras[n] if n else None for _, n in cases]
    for p, n in cases:
        assert got[(p, n)] == expected[n][p], (p, n)


@pytest.mark.parametrize("variant", [
    dict(),
    dict(max_num_batched_tokens=7),  # chunked prefill
    dict(kv_cache_memory=10 * 8 * 1024 / 2**30, preemption_mode="recompute", max_model_len=64),
    dict(python_layers=True),
])
def test_mixed_adapters_match_peft(lora_setup, variant):
    base, folders, expected = lora_setup
    variant = dict(variant)
    python_layers = variant.pop("python_layers", False)
    args = dict(dtype="float32", kv_cache_memory=0.01, block_size=8, enable_lora=True, max_loras=2, max_cpu_loras=2,
                max_lora_rank=16)
    llm = LLM(base, **{**args, **variant})
    model = llm.engine.core.executor.driver_worker.loaded.model
    model.use_cpu_decoder = not python_layers
    _mixed(llm, _requests(folders), expected)
    assert (model._cpu_decoder[1] is None) == python_layers  # the C++ layer loop ran the adapters, or did not
    usage = llm.engine.scheduler.usage()
    assert usage.free_gpu_blocks == usage.num_gpu_blocks
    if "preemption_mode" in variant:
        assert llm.engine.get_stats().num_preempted_recompute > 0


def test_prefix_cache_hits_stay_with_their_adapter(lora_setup):
    base, folders, expected = lora_setup
    loras = _requests(folders)
    llm = LLM(base, dtype="float32", kv_cache_memory=0.01, block_size=8, enable_lora=True, max_loras=3)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompt = PROMPTS[0]
    first = llm.generate([prompt], params, use_tqdm=False, lora_request=loras["qv8"])[0]
    again = llm.generate([prompt], params, use_tqdm=False, lora_request=loras["qv8"])[0]
    other = llm.generate([prompt], params, use_tqdm=False, lora_request=loras["all4rs"])[0]
    plain = llm.generate([prompt], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert list(again.outputs[0].token_ids) == expected["qv8"][0]
    assert list(other.outputs[0].token_ids) == expected["all4rs"][0]
    assert list(plain.outputs[0].token_ids) == expected[None][0]


def test_bad_adapters_are_clear_errors(lora_setup, tmp_path):
    base, folders, _ = lora_setup
    llm = LLM(base, dtype="float32", kv_cache_memory=0.01, block_size=8, enable_lora=True, max_lora_rank=8)
    engine = llm.engine
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank 8"):
        engine.add_lora(LoRARequest("mlp16", 3, folders["mlp16"]))
    with pytest.raises(ValueError, match="no adapter_config.json|not a folder"):
        engine.add_lora(LoRARequest("missing", 4, str(tmp_path / "nowhere")))
    wrong = tmp_path / "wrong"  # an adapter of another base model: 32 columns where this one has 64
    shutil.copytree(folders["qv8"], wrong)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(wrong / "adapter_model.safetensors"))
    save_file({k: (v[:, :32] if "lora_A" in k else v).contiguous() for k, v in tensors.items()},
              str(wrong / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="does not fit the base model"):
        engine.add_lora(LoRARequest("wrong", 5, str(wrong)))
    dora = tmp_path / "dora"
    shutil.copytree(folders["qv8"], dora)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        engine.add_request("r-dora", PROMPTS[0], SamplingParams(max_tokens=2), lora_request=LoRARequest("d", 6, str(dora)))
    assert engine.list_loras() == set() and not engine.has_unfinished_requests()
    # the engine still serves, with and without a good adapter; removing one works
    assert engine.add_lora(LoRARequest("qv8", 1, folders["qv8"]))
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=3), use_tqdm=False,
                       lora_request=LoRARequest("qv8", 1, folders["qv8"]))
    assert len(out[0].outputs[0].token_ids) == 3
    assert engine.list_loras() == {1} and engine.remove_lora(1) and engine.list_loras() == set()
    assert not engine.remove_lora(1)


def test_lora_needs_enable_lora(lora_setup):
    base, folders, _ = lora_setup
    llm = LLM(base, dtype="float32", kv_cache_memory=0.01, block_size=8)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=LoRARequest("qv8", 1, folders["qv8"]))
    assert not llm.engine.has_unfinished_requests()


def test_tensor_parallel_adapters_match_peft(lora_setup):
    """tp=2: B split with a column-parallel projection, A with a row-parallel one; adapters
    reach the worker rank before the steps that run them, and leave it when removed."""
    base, folders, expected = lora_setup
    loras = _requests(folders)
    llm = LLM(base, dtype="float32", kv_cache_memory=0.01, block_size=8, enable_lora=True, max_loras=3,
              tensor_parallel_size=2, num_threads=2)
    try:
        _mixed(llm, loras, expected)
        assert llm.engine.remove_lora(loras["qv8"].lora_int_id)
        _mixed(llm, loras, expected)  # read again from its files, on both ranks
    finally:
        llm.engine.shutdown()


def test_speculative_decoding_and_structured_outputs_with_adapters(lora_setup):
    """n-gram drafts are verified under each row's adapter (the output is plain decoding's); a
    grammar constrains an adapter's output as it does the base model's."""
    from vpage import StructuredOutputsParams

    base, folders, expected = lora_setup
    loras = _requests(folders)
    llm = LLM(base, dtype="float32", kv_cache_memory=0.01, block_size=8, enable_lora=True, max_loras=3,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 2})
    _mixed(llm, loras, expected)
    assert llm.engine.get_stats().spec_decode_num_draft_tokens > 0
    choice = StructuredOutputsParams(choice=["alpha", "beta", "gamma"])
    outs = llm.generate(["pick"] * 3, SamplingParams(max_tokens=8, structured_outputs=choice), use_tqdm=False,
                        lora_request=list(loras.values()))
    assert all(o.outputs[0].text in ("alpha", "beta", "gamma") for o in outs)


def test_stats_name_running_and_waiting_adapters(lora_setup):
    """max_loras 1: the second adapter's request waits for the first's to end (vLLM's
    lora_requests_info names them)."""
    base, folders, _ = lora_setup
    loras = _requests(folders)
    engine = LLM(base, dtype="float32", kv_cache_memory=0.01, block_size=8, enable_lora=True).engine
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=3), lora_request=loras["qv8"])
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=3), lora_request=loras["all4rs"])
    engine.add_request("c", PROMPTS[2], SamplingParams(max_tokens=3))
    stats = engine.get_stats()
    assert (stats.max_lora, stats.running_lora_adapters, stats.waiting_lora_adapters) == (1, (), ("all4rs", "qv8"))
    engine.step()
    stats = engine.get_stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters) == (("qv8",), ("all4rs",))
    assert engine.scheduler.num_running == 2  # the base model's request went ahead of "b"
    for _ in range(20):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
