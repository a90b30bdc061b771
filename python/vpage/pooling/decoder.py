"""Decoder embedding models (Qwen3-Embedding's kind: a Llama / Qwen folder whose
sentence-transformers config pools the last token) on vpage's own decoder classes.

Each step is one causal prefill of the packed sequences into a scratch paged KV cache (grown to
the largest step seen, reused after), through ``model(batch, kv_caches)``, which returns the
final-normed hidden states the pooler reads. No language-model head is loaded or needed:
checkpoints saved from the base model (``Qwen3Model``: no ``model.`` prefix, no ``lm_head``)
load as they are.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from vpage import ops
from vpage.model_executor.forward_batch import ForwardBatch
from vpage.model_executor.models import get_model_class
from vpage.model_executor.models.llama import LlamaForCausalLM, head_size_of, num_kv_heads_of
from vpage.pooling.batch import PackedBatch

_BLOCK_SIZE = 16


def decoder_class(hf_config: Any) -> Optional[type[LlamaForCausalLM]]:
    """vpage's decoder class for the config's architecture (``XForCausalLM``, or the base
    ``XModel`` an embedding checkpoint names), None when there is none."""
    for name in (getattr(hf_config, "architectures", None) or [])[:1]:
        for candidate in (name, name.removesuffix("Model") + "ForCausalLM"):
            try:
                return get_model_class(candidate)
            except ValueError:
                continue
    return None


def _with_model_prefix(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A base model's tensor names (``layers.0...``, ``embed_tokens``, ``norm``) as the causal
    LM's (``model.layers.0...``)."""
    for name, tensor in weights:
        yield (name if name.startswith(("model.", "lm_head.")) else f"model.{name}"), tensor


class DecoderEmbedder(nn.Module):
    """A decoder as a pooling model: ``forward(batch, rows)`` gives final-normed hidden states
    (all rows, or ``rows``), like ``EncoderModel``; no classification head."""

    num_labels = None
    head = None
    position_offset = 0

    def __init__(self, net_class: type[LlamaForCausalLM], hf_config: Any, dtype: torch.dtype):
        super().__init__()
        hf_config = copy.deepcopy(hf_config)
        hf_config.tie_word_embeddings = True  # no lm_head parameter: pooling never computes logits
        self.net = net_class(hf_config, dtype)
        self.num_layers = int(hf_config.num_hidden_layers)
        self.num_kv_heads = num_kv_heads_of(hf_config)
        self.head_size = head_size_of(hf_config)
        self.dtype = dtype
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._num_blocks = 0

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        self.net.load_weights(_with_model_prefix(weights))

    def _kv_caches(self, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Scratch caches of at least ``num_blocks`` blocks per layer (grown, never shrunk:
        reused while the steps fit, so the model's C++ layer loop is built once)."""
        if num_blocks > self._num_blocks:
            shape = (num_blocks, self.num_kv_heads, self.head_size, _BLOCK_SIZE, self.dtype)
            self._caches = [(torch.empty(ops.key_cache_shape(*shape), dtype=self.dtype, device=device),
                             torch.empty(ops.value_cache_shape(*shape), dtype=self.dtype, device=device))
                            for _ in range(self.num_layers)]
            self._num_blocks = num_blocks
        return self._caches

    def forward(self, batch: PackedBatch, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        device = batch.input_ids.device
        blocks = [-(-n // _BLOCK_SIZE) for n in batch.lens]
        first_block = [0] * len(blocks)
        for i in range(1, len(blocks)):
            first_block[i] = first_block[i - 1] + blocks[i - 1]
        width = max(blocks)
        tables = torch.tensor([list(range(b, b + n)) + [0] * (width - n) for b, n in zip(first_block, blocks)],
                              dtype=torch.int32, device=device)
        positions = batch.positions()
        seq = batch.sequence_index()
        first_slot = torch.tensor(first_block, dtype=torch.int64, device=device) * _BLOCK_SIZE
        starts = torch.tensor([*batch.starts, batch.num_tokens], dtype=torch.int32, device=device)
        step = ForwardBatch(input_ids=batch.input_ids, positions=positions, slot_mapping=first_slot[seq] + positions,
                            block_tables=tables, context_lens=torch.tensor(batch.lens, dtype=torch.int32, device=device),
                            query_start_loc=starts, max_context_len=max(batch.lens), max_query_len=max(batch.lens))
        hidden = self.net(step, self._kv_caches(sum(blocks), device))
        return hidden if rows is None else hidden[torch.tensor(rows, dtype=torch.int64, device=device)]
