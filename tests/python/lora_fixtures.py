"""Builders for the LoRA tests: a tiny random Llama, three PEFT adapters of different ranks and
target modules (one rsLoRA, one with rank and alpha patterns) saved beside it, and PEFT's own
greedy tokens for a few prompts under each."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from model_fixtures import save_tiny_model

PROMPTS = [[1, 17, 42, 99, 7, 230, 15, 61, 8, 77, 5, 301, 12], [1, 5, 9, 200], [1, 88, 3, 150, 66, 44, 120, 9, 2, 31]]
MAX_TOKENS = 12
ADAPTERS = {  # name -> peft.LoraConfig arguments
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all4rs": dict(r=4, lora_alpha=8, use_rslora=True,
                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp16": dict(r=16, lora_alpha=24, target_modules=["o_proj", "gate_proj", "down_proj"],
                  rank_pattern={"down_proj": 6}, alpha_pattern={"gate_proj": 40}),
}


def greedy_tokens(model, prompt: list[int]) -> list[int]:
    """transformers' (or PEFT's) greedy continuation of ``prompt``, MAX_TOKENS long, EOS ignored."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_lora_setup(root: Path) -> tuple[str, dict[str, str], dict]:
    """(base folder, {adapter name: folder}, {None or adapter name: [greedy tokens per prompt]})."""
    import peft

    base = save_tiny_model("llama", root / "base")
    expected = {None: [greedy_tokens(base, p) for p in PROMPTS]}
    folders = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        model = peft.get_peft_model(save_tiny_model("llama", root / f"base{i}"), peft.LoraConfig(**kwargs))
        with torch.no_grad():  # PEFT starts B at zero: random A and B that change the tokens
            for pname, param in model.named_parameters():
                if "lora_" in pname:
                    param.copy_(torch.randn_like(param) * 0.3)
        model.save_pretrained(str(root / name))
        folders[name] = str(root / name)
        expected[name] = [greedy_tokens(model.eval(), p) for p in PROMPTS]
        shutil.rmtree(root / f"base{i}")
    for name in ADAPTERS:  # the adapters do change the answers
        assert expected[name] != expected[None]
    return str(root / "base"), folders, expected
