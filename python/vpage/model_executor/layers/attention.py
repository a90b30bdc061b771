"""Paged attention layer: writes the step's K/V into the cache, then attends through it."""

from __future__ import annotations

import torch
from torch import nn

from vpage import ops
from vpage.model_executor.forward_batch import ForwardBatch


class PagedAttention(nn.Module):
    """Multi-head attention (MHA/GQA/MQA) over the paged KV cache of layer ``layer_index``.

    sliding_window W: a query at position p sees keys p - W < j <= p (None: every earlier key);
    logits_soft_cap c: scores become c * tanh(score / c) before the softmax (None: off)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float, layer_index: int = 0,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # Passed only when set, so a plain layer calls the kernels exactly as before.
        self._options = {key: value for key, value in (("sliding_window", sliding_window),
                                                        ("logits_soft_cap", logits_soft_cap)) if value is not None}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """Attend and return ``[num_tokens, num_heads * head_size]``.

        query ``[num_tokens, num_heads, head_size]`` (contiguous); key/value
        ``[num_tokens, num_kv_heads, head_size]`` (rows may be strided views).
        kv_cache: (key_cache, value_cache) in the layout of ``vpage.ops``.
        """
        key_cache, value_cache = kv_cache
        if batch.layer_events is not None:  # this layer's swaps (cache stream) before its K/V is used
            torch.cuda.current_stream(key_cache.device).wait_event(batch.layer_events[self.layer_index])
        ops.reshape_and_cache(key, value, key_cache, value_cache, batch.slot_mapping)
        out = torch.empty_like(query)
        if batch.is_decode:
            ops.paged_attention(
                query, key_cache, value_cache, batch.block_tables, batch.context_lens,
                self.scale, max_context_len=batch.max_context_len, out=out, **self._options,
            )
        else:
            draft = {"draft_queries": True} if batch.draft_queries else {}  # a decode token and its drafts
            ops.paged_prefill_attention(
                query, key_cache, value_cache, batch.block_tables, batch.query_start_loc,
                batch.context_lens, self.scale, max_context_len=batch.max_context_len, out=out, **draft,
                **self._options,
            )
        return out.view(query.shape[0], self.num_heads * self.head_size)
