"""The engine on tiny random Llama / Mistral / Qwen2 models saved to disk: greedy generation
equals transformers' generate; outputs do not depend on chunking, prefix caching or
preemption; the CLI runs on a model folder."""

from __future__ import annotations

import pytest
import torch

from model_fixtures import save_tiny_model
from vpage import LLM, SamplingParams
from vpage.cli import main as cli_main

PROMPTS = [[5, 9, 17], [3] * 40, list(range(10, 75)), [7, 8], list(range(100, 121)), [42] * 9]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = save_tiny_model(request.param, folder, seed=3)
    return folder, model


def _greedy(llm: LLM, max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_greedy_matches_transformers(tiny):
    folder, hf = tiny
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=0.01, block_size=8)
    for prompt, ours in zip(PROMPTS, _greedy(llm)):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert ours == ref[0, len(prompt):].tolist()


def test_outputs_do_not_depend_on_batching_or_memory_pressure(tiny):
    folder, _ = tiny
    base = _greedy(LLM(str(folder), dtype="float32", kv_cache_memory=0.01, block_size=8), 20)
    variants = {
        "no prefix caching, no chunking": dict(enable_prefix_caching=False, enable_chunked_prefill=False,
                                               max_num_batched_tokens=256),
        "tiny token budget (chunked prefill)": dict(max_num_batched_tokens=7),
        "recompute under a tiny KV pool": dict(kv_cache_memory=12 * 8 * 1024 / 2**30, preemption_mode="recompute",
                                               max_model_len=96),
        "swap under a tiny KV pool": dict(kv_cache_memory=12 * 8 * 1024 / 2**30, preemption_mode="swap",
                                          max_model_len=96),
    }
    for name, kwargs in variants.items():
        args = dict(dtype="float32", kv_cache_memory=0.01, block_size=8)
        args.update(kwargs)
        llm = LLM(str(folder), **args)
        assert _greedy(llm, 20) == base, name
        usage = llm.engine.scheduler.usage()
        assert usage.free_gpu_blocks == usage.num_gpu_blocks, name
        if "tiny KV pool" in name:
            stats = llm.engine.get_stats()
            assert stats.num_preempted_recompute + stats.num_preempted_swap > 0, name


def test_cli_generate_streams_text(tiny, capsys):
    folder, _ = tiny
    assert cli_main(["generate", "the quick brown fox", "--model", str(folder), "--max-tokens", "8",
                     "--kv-cache-memory", "0.01"]) == 0
    streamed = capsys.readouterr().out
    llm = LLM(str(folder), kv_cache_memory=0.01)
    expected = llm.generate("the quick brown fox", SamplingParams(temperature=0.0, max_tokens=8),
                            use_tqdm=False)[0].outputs[0].text
    assert expected.strip() and streamed.rstrip("\n") == expected
    assert cli_main(["generate", "x", "--model", str(folder / "missing")]) == 2
    assert "no such model" in capsys.readouterr().err


def test_kv_cache_larger_than_the_machine_is_a_clear_error(tiny):
    folder, _ = tiny
    with pytest.raises(ValueError, match="GiB of host memory, more than this machine's"):
        LLM(str(folder), dtype="float32", kv_cache_memory=1e6)
    with pytest.raises(ValueError, match="GiB of host memory"):
        LLM(str(folder), dtype="float32", kv_cache_memory=0.01, swap_space=1e6)
