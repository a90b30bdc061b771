"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers' own GGUF load."""

from __future__ import annotations

import pytest
import torch

from model_fixtures import PagedKVCache
from vpage.model_executor import load_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def vpage_model():
    # The dequantized float32 path, as transformers runs it (the quantized path: test_quant_engine.py).
    return load_model("smollm2", dtype="float32", device="cpu", quantization="none")


def test_config_and_tokenizer(vpage_model):
    c = vpage_model.config
    assert c.architecture == "LlamaForCausalLM"
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_size, c.hidden_size) == (30, 9, 3, 64, 576)
    assert c.vocab_size == 49152 and c.max_model_len == 8192
    assert 2 in c.eos_token_ids
    assert vpage_model.tokenizer.decode(vpage_model.tokenizer.encode("Hello world")) == "Hello world"
    assert vpage_model.model.lm_head is vpage_model.model.model.embed_tokens


def test_gguf_config_matches_transformers(vpage_model, hf_config):
    ours = vpage_model.hf_config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "rope_parameters"):
        assert getattr(ours, key) == getattr(hf_config, key), key


def test_logits_and_greedy_match_transformers(vpage_model, hf_model):
    tok = vpage_model.tokenizer
    prompts = {i: tok.encode(p) for i, p in enumerate(PROMPTS)}
    cache = PagedKVCache(vpage_model.config, num_blocks=32, block_size=16)
    model = vpage_model.model
    batch = cache.step(prompts)
    logits = model.compute_logits(model(batch, cache.caches))[batch.query_start_loc[1:].long() - 1]
    for step in range(4):
        with torch.no_grad():
            ref = torch.stack([hf_model(torch.tensor([t])).logits[0, -1] for t in prompts.values()])
        torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-3)
        greedy = logits.argmax(-1)
        assert greedy.tolist() == ref.argmax(-1).tolist(), f"step {step}"
        for s, t in zip(prompts, greedy.tolist()):
            prompts[s].append(t)
        logits = model.compute_logits(model(cache.step({s: [prompts[s][-1]] for s in prompts}), cache.caches))
