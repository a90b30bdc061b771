"""Engine-level greedy parity with transformers for a model family, on a tiny random model
folder (``model_fixtures.save_tiny_model`` or a family's own builder).

``assert_family_parity`` builds a random prompt (longer than the model's sliding window when
it has one), a short one, another long one, and a second turn (the first prompt + its answer
+ new tokens), and
checks that vpage's offline ``LLM`` gives transformers' greedy tokens under each named engine
setting of ``ENGINE_SETTINGS``: plain, chunked prefill, prefix caching across turns,
recompute preemption under a tiny KV pool, tensor parallelism.

A family's test::

    @pytest.mark.parametrize("setting", setting_params(["plain", "chunked", "prefix", "preempt", "tp2"]))
    def test_engine_matches_transformers(tiny, setting):
        folder, hf = tiny
        assert_family_parity(folder, hf, [setting], prompt_len=40)
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any, Iterable, Sequence

import pytest
import torch

from vpage import LLM, SamplingParams
from vpage.model_executor.models.llama import layer_sliding_window

BLOCK_SIZE = 8
# engine_greedy's stand-in for "KV blocks for the longest request alone" (setting "preempt").
ONE_SEQUENCE = "one_sequence"

# Named engine kwargs sets (EngineArgs fields, plus ``kv_blocks`` and ``one_by_one`` that
# engine_greedy resolves).
ENGINE_SETTINGS: dict[str, dict[str, Any]] = {
    # Whole prompts in one step, nothing cached.
    "plain": dict(enable_prefix_caching=False, enable_chunked_prefill=False, max_num_batched_tokens=4096),
    # A token budget of 7: every prompt is cut into chunks that straddle block boundaries.
    "chunked": dict(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=7),
    # One generate call per prompt on one engine: the second turn finds the first turn's
    # prompt and answer blocks in the prefix cache.
    "prefix": dict(enable_prefix_caching=True, one_by_one=True),
    # KV blocks for the longest request alone while all run at once: sequences are preempted
    # and recomputed.
    "preempt": dict(enable_prefix_caching=False, preemption_mode="recompute", kv_blocks=ONE_SEQUENCE),
    "tp2": dict(tensor_parallel_size=2),
}
SLOW_SETTINGS = frozenset({"tp2"})  # worker processes: one such case per family is enough


def setting_params(names: Iterable[str]) -> list:
    """pytest parameters for ``names`` of ENGINE_SETTINGS, the slow ones marked slow."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_SETTINGS else name for name in names]


def hf_greedy(hf_model: Any, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt_ids``: exactly ``max_new_tokens`` tokens
    (no end-of-sequence stop), in float32."""
    hf_model = hf_model.float().eval()
    ids = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def model_windows(hf_config: Any) -> list[int]:
    """The sliding windows vpage's layers use (none for a window as long as the positions)."""
    windows = (layer_sliding_window(hf_config, i) for i in range(hf_config.num_hidden_layers))
    return [w for w in windows if w is not None]


def _hf_config(model_path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_path), local_files_only=True)


def _block_bytes(hf_config: Any, block_size: int) -> int:
    """float32 bytes of one KV block over all layers (keys and values)."""
    heads = hf_config.num_attention_heads
    head_size = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return 2 * hf_config.num_hidden_layers * kv_heads * head_size * block_size * 4


def _run(model_path: Path, prompts_ids: Sequence[Sequence[int]], max_new_tokens: int,
         **engine_kwargs: Any) -> tuple[list[list[int]], Any]:
    """(greedy tokens per prompt, engine stats) of one engine; every block is free at the end."""
    one_by_one = engine_kwargs.pop("one_by_one", False)
    kv_blocks = engine_kwargs.pop("kv_blocks", None)
    longest = max(len(p) for p in prompts_ids) + max_new_tokens
    args: dict[str, Any] = dict(dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=0.01, swap_space=0.01,
                                num_threads=1, max_model_len=longest)
    args.update(engine_kwargs)
    if kv_blocks is not None:
        if kv_blocks == ONE_SEQUENCE:
            kv_blocks = math.ceil(args["max_model_len"] / args["block_size"])
        # Half a block over: the engine floors the pool to whole blocks.
        args["kv_cache_memory"] = (kv_blocks + 0.5) * _block_bytes(_hf_config(model_path), args["block_size"]) / 2**30
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    llm = LLM(str(model_path), **args)
    try:
        batches = [[p] for p in prompts_ids] if one_by_one else [list(prompts_ids)]
        tokens = [o.outputs[0].token_ids for batch in batches
                  for o in llm.generate([list(p) for p in batch], params, use_tqdm=False)]
        usage = llm.engine.scheduler.usage()
        assert usage.free_gpu_blocks == usage.num_gpu_blocks, "blocks left in use after every request finished"
        return [list(t) for t in tokens], llm.engine.get_stats()
    finally:
        llm.shutdown()


def engine_greedy(model_path: Path, prompts_ids: Sequence[Sequence[int]], max_new_tokens: int,
                  **engine_kwargs: Any) -> list[list[int]]:
    """vpage's greedy tokens (exactly ``max_new_tokens`` each) for ``prompts_ids``, through the
    offline ``LLM`` on ``model_path`` in float32 with blocks of ``BLOCK_SIZE``.

    engine_kwargs: EngineArgs fields over the defaults (kv_cache_memory 0.01 GiB, one thread,
    max_model_len = the longest request), and
      kv_blocks: the KV pool in blocks (an int, or ONE_SEQUENCE: the longest request's);
      one_by_one: one generate call per prompt, in order, on the same engine."""
    return _run(model_path, prompts_ids, max_new_tokens, **engine_kwargs)[0]


def parity_prompts(hf_config: Any, hf_model: Any, prompt_len: int, max_new_tokens: int,
                   seed: int = 0) -> list[list[int]]:
    """[first, short, other, second turn]: a random prompt of ``prompt_len`` tokens (longer
    than the sliding window, if any), a short one, another of ``prompt_len``, and the first +
    transformers' answer to it + 11 new tokens. Under "preempt" the first three are admitted
    together and outgrow the pool while the second turn waits for it."""
    windows = model_windows(hf_config)
    if windows and prompt_len <= max(windows):
        raise ValueError(f"prompt_len {prompt_len} must exceed the sliding window {max(windows)}")
    rng = random.Random(seed)
    vocab = range(3, hf_config.vocab_size)  # past the special ids
    first = [rng.choice(vocab) for _ in range(prompt_len)]
    short = [rng.choice(vocab) for _ in range(5)]
    other = [rng.choice(vocab) for _ in range(prompt_len)]
    second = first + hf_greedy(hf_model, first, max_new_tokens) + [rng.choice(vocab) for _ in range(11)]
    return [first, short, other, second]


def assert_family_parity(model_folder: Path, hf_model: Any, settings: Iterable[str], prompt_len: int,
                         max_new_tokens: int = 32) -> None:
    """For each named setting of ENGINE_SETTINGS, vpage's greedy tokens on the prompts of
    ``parity_prompts`` equal transformers' (``hf_model``: the model saved in ``model_folder``).

    For a model without sliding windows it also checks that each setting did what it stands
    for: "prefix" served the second turn from the prefix cache, "preempt" preempted. (With a
    window the block manager may free blocks that fall out of it, so a second turn may find
    fewer cached and every sequence may fit the pool; the tokens must match all the same.)"""
    prompts = parity_prompts(hf_model.config, hf_model, prompt_len, max_new_tokens)
    expected = [hf_greedy(hf_model, p, max_new_tokens) for p in prompts]
    windowed = bool(model_windows(hf_model.config))
    for name in settings:
        got, stats = _run(Path(model_folder), prompts, max_new_tokens, **ENGINE_SETTINGS[name])
        for i, (ours, ref) in enumerate(zip(got, expected)):
            first_diff = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
            assert ours == ref, (f"setting {name!r}, prompt {i} ({len(prompts[i])} tokens): first difference at "
                                 f"new token {first_diff}\nvpage        {ours}\ntransformers {ref}")
        if name == "prefix" and not windowed:
            # The first turn's K/V covers its prompt and all but its last answer token.
            assert stats.prefix_cache_hits >= (prompt_len + max_new_tokens - 1) // BLOCK_SIZE, \
                f"the second turn found {stats.prefix_cache_hits} blocks in the prefix cache"
        if name == "preempt" and not windowed:
            assert stats.num_preempted_recompute > 0, "nothing was preempted"
