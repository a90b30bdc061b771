"""Tiny random Llama/Mistral/Qwen2 models: vpage logits match transformers (float32)."""

from __future__ import annotations

import json

import pytest
import torch

from model_fixtures import PagedKVCache, save_tiny_model
from vpage.model_executor import load_model

ATOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "llama-sharded"])
def tiny(request, tmp_path_factory):
    kind, _, sharded = request.param.partition("-")
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(kind, folder, max_shard_size="20KB" if sharded else None)
    if sharded:
        assert (folder / "model.safetensors.index.json").is_file()
    return hf, load_model(str(folder), dtype="float32", device="cpu")


def hf_logits(hf, tokens: list[int], last: int) -> torch.Tensor:
    """Reference logits ``[last, vocab]`` of the last ``last`` tokens of a full forward."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -last:]


def run_step(loaded, cache: PagedKVCache, chunks: dict[int, list[int]]) -> torch.Tensor:
    batch = cache.step(chunks)
    return loaded.model.compute_logits(loaded.model(batch, cache.caches))


def test_config(tiny):
    _, loaded = tiny
    c = loaded.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_size, c.hidden_size) == (2, 4, 2, 16, 64)
    assert c.dtype == torch.float32 and c.eos_token_ids == [2] and loaded.tokenizer is not None
    assert c.cache_block_bytes(16) == 2 * 2 * 2 * 16 * 16 * 4


def test_prefill_then_decode(tiny):
    hf, loaded = tiny
    gen = torch.Generator().manual_seed(1)
    seqs = {s: torch.randint(3, 320, (n,), generator=gen).tolist() for s, n in enumerate([13, 1, 29, 8])}
    cache = PagedKVCache(loaded.config, block_size=8)
    logits = run_step(loaded, cache, seqs)
    ref = torch.cat([hf_logits(hf, t, len(t)) for t in seqs.values()])
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    for _ in range(4):
        step = {s: [int(torch.randint(3, 320, (1,), generator=gen))] for s in seqs}
        for s, t in step.items():
            seqs[s] += t
        logits = run_step(loaded, cache, step)
        ref = torch.cat([hf_logits(hf, t, 1) for t in seqs.values()])
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


def test_chunked_prefill_mixed_with_decode(tiny):
    hf, loaded = tiny
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(3, 320, (11,), generator=gen).tolist()
    b = torch.randint(3, 320, (37,), generator=gen).tolist()
    cache = PagedKVCache(loaded.config, block_size=16, seed=3)
    run_step(loaded, cache, {0: a})
    a.append(5)
    # b's prompt over two forwards; the first shares the step with a decode token of a.
    logits = run_step(loaded, cache, {0: [5], 1: b[:20]})
    ref = torch.cat([hf_logits(hf, a, 1), hf_logits(hf, b[:20], 20)])
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    logits = run_step(loaded, cache, {1: b[20:]})
    torch.testing.assert_close(logits, hf_logits(hf, b, 17), atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close(tiny, tmp_path, dtype):
    hf, _ = tiny
    folder = tmp_path / "m"
    hf.save_pretrained(str(folder))
    loaded = load_model(str(folder), dtype=dtype, device="cpu")
    assert loaded.config.dtype == getattr(torch, dtype)
    tokens = list(range(3, 40))
    cache = PagedKVCache(loaded.config)
    logits = run_step(loaded, cache, {0: tokens})
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits(hf, tokens, len(tokens)), atol=0.05, rtol=0.05)
    logits = run_step(loaded, cache, {0: [7]})
    torch.testing.assert_close(logits, hf_logits(hf, tokens + [7], 1), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("eos", [None, "<s>", "vocab"])
def test_without_the_tokenizer_the_same_eos_ids(tmp_path, eos):
    # The engine-core process of a server loads no tokenizer: the EOS ids it stops on are read
    # from the files (tokenizer_config.json's eos_token among tokenizer.json's added tokens or
    # vocabulary) and equal those of a load with the tokenizer, also for an EOS only the
    # tokenizer names.
    save_tiny_model("llama", tmp_path)
    if eos is not None:
        spec = json.loads((tmp_path / "tokenizer.json").read_text())
        token = eos if eos != "vocab" else sorted(t for t in spec["model"]["vocab"] if len(t) > 2)[0]
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": token}))
    loaded = load_model(str(tmp_path), "float32", "cpu")
    bare = load_model(str(tmp_path), "float32", "cpu", with_tokenizer=False)
    assert bare.tokenizer is None and loaded.tokenizer.eos_token_id in bare.config.eos_token_ids
    assert bare.config.eos_token_ids == loaded.config.eos_token_ids == sorted({2, loaded.tokenizer.eos_token_id})


def test_the_default_model_without_its_tokenizer_has_its_eos():
    assert load_model(None, with_tokenizer=False).config.eos_token_ids == load_model(None).config.eos_token_ids
