"""Float64 reference for the paged KV cache kernels (shared by the CPU and CUDA tests).

Layout (per layer, x = 16 // element_size):
    key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value_cache [num_blocks, num_kv_heads, head_size, block_size]
The reference gathers K/V through the block table, then runs plain causal attention
(optionally with a sliding window and attention-logit soft-capping).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch


def pack_size(dtype: torch.dtype) -> int:
    """Elements per 16-byte key fragment (the key cache's innermost dimension x)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def make_random_cache(num_blocks: int, num_kv_heads: int, head_size: int, block_size: int,
                      dtype: torch.dtype, device="cpu",
                      generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A random (uniform in [-1, 1)) key/value cache pair of one layer."""
    x = pack_size(dtype)
    key = torch.rand((num_blocks, num_kv_heads, head_size // x, block_size, x),
                     generator=generator, dtype=torch.float32) * 2 - 1
    value = torch.rand((num_blocks, num_kv_heads, head_size, block_size),
                       generator=generator, dtype=torch.float32) * 2 - 1
    return key.to(dtype=dtype, device=device), value.to(dtype=dtype, device=device)


def make_block_tables(context_lens: Sequence[int], block_size: int, num_blocks: int,
                      generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """int32 [num_seqs, max_blocks]: distinct, shuffled physical blocks per sequence (padding 0)."""
    needed = [(n + block_size - 1) // block_size for n in context_lens]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed, cache has {num_blocks}")
    physical = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros((len(context_lens), max(needed + [1])), dtype=torch.int32)
    start = 0
    for s, n in enumerate(needed):
        tables[s, :n] = physical[start:start + n]
        start += n
    return tables


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
              context_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence as float64 [context_len, num_kv_heads, head_size]."""
    num_blocks_used = (context_len + key_cache.shape[3] - 1) // key_cache.shape[3]
    ids = block_table[:num_blocks_used].long().to(key_cache.device)
    k = key_cache[ids].double()  # [n, kv, hs/x, bs, x]
    v = value_cache[ids].double()  # [n, kv, hs, bs]
    n, kv, chunks, bs, x = k.shape
    k = k.permute(0, 3, 1, 2, 4).reshape(n * bs, kv, chunks * x)
    v = v.permute(0, 3, 1, 2).reshape(n * bs, kv, chunks * x)
    return k[:context_len].cpu(), v[:context_len].cpu()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            sliding_window: Optional[int] = None, logits_soft_cap: Optional[float] = None) -> torch.Tensor:
    """q [nq, heads, hs] are the last nq positions of k/v [len, kv, hs]; causal; float64.
    sliding_window W: the query at position p sees keys j with p - W < j <= p;
    logits_soft_cap c: scores s become c * tanh(s / c) before the softmax."""
    nq, heads, _ = q.shape
    length, kv, _ = k.shape
    group = heads // kv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.double().cpu(), k) * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    positions = torch.arange(length)
    visible_end = length - nq + torch.arange(nq) + 1
    hidden = positions[None, :] >= visible_end[:, None]
    if sliding_window is not None:
        hidden |= positions[None, :] < visible_end[:, None] - sliding_window
    logits = logits.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v)


def reference_paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                              scale: float, sliding_window: Optional[int] = None,
                              logits_soft_cap: Optional[float] = None) -> torch.Tensor:
    """Decode: float64 [num_seqs, num_heads, head_size] (one query per sequence)."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        k, v = gather_kv(key_cache, value_cache, block_tables[s].cpu(), length)
        out[s] = _attend(query[s:s + 1], k, v, scale, sliding_window, logits_soft_cap)[0]
    return out


def reference_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                                context_lens, scale: float, max_rows: int = 256,
                                sliding_window: Optional[int] = None,
                                logits_soft_cap: Optional[float] = None) -> torch.Tensor:
    """Causal prefill: float64 [num_tokens, num_heads, head_size]; the queries of sequence s
    are rows [query_start_loc[s], query_start_loc[s+1]), the last tokens of its context.
    Queries go in chunks of at most ``max_rows`` (chunk [a, b) of q queries over a context of
    L tokens = the last b - a queries of a context of L - (q - b) tokens), bounding memory."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for s, length in enumerate(context_lens.tolist()):
        begin, end = starts[s], starts[s + 1]
        if end == begin:
            continue
        k, v = gather_kv(key_cache, value_cache, block_tables[s].cpu(), length)
        for a in range(begin, end, max_rows):
            b = min(end, a + max_rows)
            visible = length - (end - b)
            out[a:b] = _attend(query[a:b], k[:visible], v[:visible], scale, sliding_window, logits_soft_cap)
    return out


def blocks_before_window(context_len: int, num_queries: int, sliding_window: Optional[int],
                         block_size: int) -> int:
    """Logical blocks of a sequence wholly before the window of its earliest query (at
    position context_len - num_queries): the blocks paged attention never reads."""
    if sliding_window is None or num_queries == 0:
        return 0
    return max(0, context_len - num_queries - sliding_window + 1) // block_size


def free_blocks_before_window(key_cache, value_cache, block_tables, context_lens: Sequence[int],
                              query_lens: Optional[Sequence[int]], sliding_window: Optional[int]):
    """As the block manager leaves a windowed layer: (key_cache, value_cache, table, count)
    where the blocks wholly before each sequence's window hold NaN (copies of the caches) and
    their entries in the copied table are -1; count is the number of such blocks. query_lens
    None means decode (one query per sequence)."""
    key_cache, value_cache, table = key_cache.clone(), value_cache.clone(), block_tables.clone()
    block_size = value_cache.shape[3]
    count = 0
    for s, length in enumerate(context_lens):
        queries = 1 if query_lens is None else query_lens[s]
        dead = blocks_before_window(length, queries, sliding_window, block_size)
        ids = block_tables[s, :dead].long()
        key_cache[ids] = float("nan")
        value_cache[ids] = float("nan")
        table[s, :dead] = -1
        count += dead
    return key_cache, value_cache, table, count
