"""Builders for the model tests: tiny random HF models saved to disk, and a paged KV
cache that assigns random physical blocks and builds ForwardBatch steps."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from vpage import ops
from vpage.model_executor import ForwardBatch, ModelConfig

TINY_VOCAB = 320
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=TINY_VOCAB,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
# Per kind: Qwen3's head_dim other than hidden / heads, as its real sizes have; the mixtures of
# experts' routing (Qwen2-MoE: a shared expert, a dense first layer; Qwen3-MoE: 8 experts, top 3
# renormalised).
_TINY_EXTRA = {
    "llama": {"rope_theta": 500.0},
    "qwen3": {"head_dim": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 96},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                  "shared_expert_intermediate_size": 96, "mlp_only_layers": [0], "norm_topk_prob": False},
    "qwen3_moe": {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 48,
                  "norm_topk_prob": True},
}
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "paged attention keeps the kv cache in fixed size blocks",
    "héllo wörld, ünïcode façade — naïve café 日本語 テキスト",
]


def tiny_hf_config(kind: str, **overrides):
    """A tiny transformers config of ``kind`` (llama, mistral, qwen2, qwen3; the mixtures of
    experts mixtral, qwen2_moe, qwen3_moe), float32."""
    import transformers

    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
               "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig"}
    cls = getattr(transformers, classes[kind])
    return cls(**{**_TINY, **_TINY_EXTRA.get(kind, {}), **overrides})


def save_tiny_tokenizer(folder: Path) -> None:
    """Train a small byte-level BPE tokenizer locally and save it into ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))


def save_tiny_model(kind: str, folder: Path, max_shard_size: str | None = None, seed: int = 0, **overrides):
    """Build a random tiny model, save it (safetensors) and a tokenizer; return it (eval).

    ``overrides`` replace fields of the tiny config (e.g. rope_scaling)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind, **overrides), dtype=torch.float32).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    save_tiny_tokenizer(folder)
    return model


class PagedKVCache:
    """Per-layer KV caches plus block tables for a few sequences, blocks drawn at random."""

    def __init__(self, config: ModelConfig, num_blocks: int = 64, block_size: int = 8, seed: int = 0):
        dtype = config.cache_dtype
        args = (num_blocks, config.num_kv_heads, config.head_size, block_size, dtype)
        self.caches = [
            (torch.zeros(ops.key_cache_shape(*args), dtype=dtype),
             torch.zeros(ops.value_cache_shape(*args), dtype=dtype))
            for _ in range(config.num_layers)
        ]
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _slot(self, seq: int, pos: int) -> int:
        table = self.tables.setdefault(seq, [])
        while len(table) <= pos // self.block_size:
            table.append(self.free.pop())
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, chunks: dict[int, list[int]]) -> ForwardBatch:
        """A batch feeding ``chunks[seq]`` (new token ids) to each sequence, in dict order."""
        ids, positions, slots, starts, ctx = [], [], [], [0], []
        for seq, tokens in chunks.items():
            start = self.lens.get(seq, 0)
            for i, tok in enumerate(tokens):
                ids.append(tok)
                positions.append(start + i)
                slots.append(self._slot(seq, start + i))
            self.lens[seq] = start + len(tokens)
            starts.append(starts[-1] + len(tokens))
            ctx.append(self.lens[seq])
        width = max(len(self.tables[s]) for s in chunks)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in chunks]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_context_len=max(ctx),
            max_query_len=max(len(t) for t in chunks.values()),
        )


def save_tiny_gguf(hf_model, folder: Path, path: Path, quantize=None) -> None:
    """Write ``hf_model`` and the tokenizer of ``folder`` as a GGUF file the way llama.cpp's
    converter does (``gguf_writer.write_gguf``)."""
    from gguf_writer import write_gguf

    write_gguf(hf_model, folder, path, quantize)
