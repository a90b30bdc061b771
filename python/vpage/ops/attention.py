"""Paged attention over the KV cache: decode (one query token per sequence) and causal
(chunked) prefill, with an optional sliding window and logit soft cap."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from vpage.ops._common import _backend, _check_tensor, _checking
from vpage.ops.kv_cache import _check_activation_dtype, _check_caches, _check_rows


_INT32_MAX = 2**31 - 1


def _check_window_args(sliding_window: object, logits_soft_cap: object) -> None:
    """sliding_window: None or a positive int; logits_soft_cap: None or a positive finite float."""
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
            raise TypeError(f"sliding_window must be a positive int or None (no window), got {sliding_window!r}")
        if sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int or None (no window), got {sliding_window!r}")
    if logits_soft_cap is not None:
        if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, numbers.Real):
            raise TypeError(f"logits_soft_cap must be a positive finite float or None (no cap), "
                            f"got {logits_soft_cap!r}")
        if not math.isfinite(logits_soft_cap) or logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be a positive finite float or None (no cap), "
                             f"got {logits_soft_cap!r}")


def _draft_option(draft_queries: bool) -> dict:
    """The CPU backend's draft_queries keyword, passed only when set (the CUDA backend has none)."""
    return {"draft_queries": True} if draft_queries else {}


def _attention(query, key_cache, value_cache, block_tables, context_lens, query_start_loc,
               scale, max_context_len, out, sliding_window, logits_soft_cap, draft_queries=False) -> torch.Tensor:
    device = key_cache.device
    if _checking():
        _check_window_args(sliding_window, logits_soft_cap)
    # The kernels' encoding: 0 = off (a window of at least the context is no window).
    window = 0 if sliding_window is None else min(int(sliding_window), _INT32_MAX)
    cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
    if not _checking():
        if max_context_len is None:
            max_context_len = int(context_lens.max()) if context_lens.shape[0] else 0
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=device)
        _backend(device).paged_attention(out, query, key_cache, value_cache, block_tables,
                                         context_lens, query_start_loc, float(scale), max_context_len,
                                         window, cap, **_draft_option(draft_queries))
        return out
    _, num_kv_heads, head_size, _ = _check_caches(key_cache, value_cache)
    _check_tensor("query", query, device=device, contiguous=False)
    _check_activation_dtype("query", query, key_cache)
    _check_rows("query", query)
    num_heads = query.shape[1]
    if query.shape[2] != head_size:
        raise ValueError(f"query head_size {query.shape[2]} != cache head_size {head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    _check_tensor("block_tables", block_tables, dtype=torch.int32, ndim=2, device=device)
    _check_tensor("context_lens", context_lens, dtype=torch.int32, ndim=1, device=device)
    num_seqs = context_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, context_lens {num_seqs}")
    if query_start_loc is None:
        if query.shape[0] != num_seqs:
            raise ValueError(f"decode query has {query.shape[0]} tokens for {num_seqs} sequences")
    else:
        _check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, ndim=1, device=device)
        if query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
                             f"got {query_start_loc.shape[0]}")
    if not isinstance(scale, (float, int)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float, got {scale!r}")
    if max_context_len is None:
        max_context_len = int(context_lens.max()) if num_seqs else 0
    elif not isinstance(max_context_len, int) or max_context_len < 0:
        raise ValueError(f"max_context_len must be a non-negative int, got {max_context_len!r}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=device)
    else:
        _check_tensor("out", out, dtype=query.dtype, device=device)
        if out.shape != query.shape:
            raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    _backend(device).paged_attention(out, query, key_cache, value_cache, block_tables,
                                     context_lens, query_start_loc, float(scale), max_context_len,
                                     window, cap, **_draft_option(draft_queries))
    return out


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    max_context_len: Optional[int] = None,
                    out: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                    logits_soft_cap: Optional[float] = None) -> torch.Tensor:
    """Decode attention: one query token per sequence over its cached K/V.

    query [num_seqs, num_heads, head_size] (cache dtype, or float32 on CPU; num_heads a multiple of
    num_kv_heads), block_tables int32 [num_seqs, max_blocks], context_lens int32 [num_seqs]
    (tokens in the cache, including the query's). Returns out [num_seqs, num_heads, head_size].

    sliding_window (positive int, None = off): a query at position p attends keys at positions
    j with p - sliding_window < j <= p; blocks wholly before the window are not read, and their
    block-table entries may hold anything (e.g. -1 for freed blocks). logits_soft_cap (positive
    float, None = off): each score s = scale * (q . k) becomes cap * tanh(s / cap) before the
    softmax.
    """
    return _attention(query, key_cache, value_cache, block_tables, context_lens, None, scale,
                      max_context_len, out, sliding_window, logits_soft_cap)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                            scale: float, max_context_len: Optional[int] = None,
                            out: Optional[torch.Tensor] = None, sliding_window: Optional[int] = None,
                            logits_soft_cap: Optional[float] = None, draft_queries: bool = False) -> torch.Tensor:
    """Causal (chunked) prefill attention over cached K/V.

    query [num_tokens, num_heads, head_size]; the tokens of sequence s are rows
    [query_start_loc[s], query_start_loc[s+1]) (int32 [num_seqs + 1]) and are the last
    tokens of its context_lens[s] tokens, whose K/V are already in the cache.
    sliding_window and logits_soft_cap as in :func:`paged_attention` (blocks wholly before the
    window of a sequence's first query are not read).

    draft_queries (CPU): each sequence's rows are a decode token and its draft tokens
    (speculative decoding); each is scored by the decode kernel, bitwise as a decode step at its
    position would score it (the K/V read once for all of a sequence's rows).
    """
    if draft_queries and key_cache.device.type != "cpu":
        raise ValueError("draft_queries is a CPU kernel option; on CUDA give each draft its own decode query")
    return _attention(query, key_cache, value_cache, block_tables, context_lens,
                      query_start_loc, scale, max_context_len, out, sliding_window, logits_soft_cap,
                      draft_queries)


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_info: torch.Tensor,
                     scale: float, out: Optional[torch.Tensor] = None, window: Optional[int] = None) -> torch.Tensor:
    """Bidirectional attention over packed sequences (encoders; CPU): no cache, no padding.

    query, key, value, out ``[rows, num_heads, head_size]`` of one dtype (rows may be strided, as
    views of a fused QKV output; each row's heads contiguous); head_size a multiple of 16.
    seq_info int32 ``[5, num_seqs]``: per sequence the first key/value row, its length, the first
    query row, its number of queries and the position of its first query within the sequence.
    Every query sees all of its sequence's keys, or with ``window`` w those at most w positions
    before or after it. Returns out (allocated when None).
    """
    device = query.device
    if device.type != "cpu":
        raise ValueError(f"packed_attention runs on the CPU, got tensors on {device}")
    win = 0 if window is None else window
    if _checking():
        for name, t in (("query", query), ("key", key), ("value", value)):
            _check_tensor(name, t, dtype=query.dtype, device=device, contiguous=False)
            _check_rows(name, t)
        if key.shape[1:] != query.shape[1:] or value.shape != key.shape:
            raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} "
                             "must share [num_heads, head_size], key and value their rows")
        _check_tensor("seq_info", seq_info, dtype=torch.int32, ndim=2, device=device)
        if seq_info.shape[0] != 5:
            raise ValueError(f"seq_info must have shape [5, num_seqs], got {tuple(seq_info.shape)}")
        if isinstance(win, bool) or not isinstance(win, numbers.Integral) or win < 0:
            raise ValueError(f"window must be a positive int or None (no window), got {window!r}")
        if out is not None:
            _check_tensor("out", out, dtype=query.dtype, device=device, contiguous=False)
            _check_rows("out", out)
            if out.shape != query.shape:
                raise ValueError(f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=device)
    _backend(device).packed_attention(out, query, key, value, seq_info, float(scale), min(int(win), _INT32_MAX))
    return out
