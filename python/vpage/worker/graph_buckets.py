"""Which decode steps replay a captured CUDA graph, and how a step is padded up to its graph's
batch size. Pure numpy and integers, so the rules are tested without a GPU."""

from __future__ import annotations

from bisect import bisect_left
from typing import Optional

import numpy as np

MAX_GRAPH_BATCH = 256  # larger decode batches run eagerly (launch overhead no longer dominates)
MAX_GRAPH_CONTEXT = 8192  # graphs attend over at most this many tokens; longer contexts run eagerly
_SMALL_SIZES = (1, 2, 4, 8)
_SIZE_STEP = 8


def graph_batch_sizes(max_num_seqs: int, cap: int = MAX_GRAPH_BATCH) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then every multiple of 8 from 16, and the limit
    itself (``min(max_num_seqs, cap)``), so every decode batch up to the limit has a graph."""
    limit = max(1, min(max_num_seqs, cap))
    sizes = {b for b in _SMALL_SIZES if b <= limit} | set(range(16, limit + 1, _SIZE_STEP)) | {limit}
    return sorted(sizes)


def padded_batch_size(num_seqs: int, sizes: list[int]) -> Optional[int]:
    """The smallest captured size >= ``num_seqs`` (``sizes`` ascending), None when none is."""
    i = bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def graph_batch_for(num_seqs: int, max_query_len: int, max_context_len: int, table_width: int,
                    sizes: list[int], max_graph_context: int, max_graph_blocks: int) -> Optional[int]:
    """The graph batch size a step replays, or None to run it eagerly: only decode steps
    (one query token per row) whose rows, contexts and block tables fit a captured graph."""
    if num_seqs == 0 or max_query_len != 1:
        return None
    if max_context_len > max_graph_context or table_width > max_graph_blocks:
        return None
    return padded_batch_size(num_seqs, sizes)


def fill_padded_decode(host: dict[str, np.ndarray], input_ids: np.ndarray, positions: np.ndarray,
                       slot_mapping: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray,
                       batch: int, scratch_block: int) -> None:
    """Writes a decode step's rows into the first ``batch`` rows of a graph's host inputs
    (``input_ids``, ``positions``, ``slot_mapping`` [B]; ``context_lens`` [B];
    ``block_tables`` [B, W]) and makes rows ``num_seqs:batch`` padding: slot -1 (their K/V
    are not written) and context length 1 in ``scratch_block`` (they read one token of a
    block no sequence owns). Columns past a row's table are stale but never read."""
    n = context_lens.shape[0]
    width = block_tables.shape[1] if block_tables.ndim == 2 else 0
    if n > batch or batch > host["context_lens"].shape[0] or width > host["block_tables"].shape[1]:
        raise ValueError(f"a decode step of {n} rows x {width} blocks does not fit a graph of {batch} rows x "
                         f"{host['block_tables'].shape[1]} blocks")
    for name, rows, pad in (("input_ids", input_ids, 0), ("positions", positions, 0),
                            ("slot_mapping", slot_mapping, -1), ("context_lens", context_lens, 1)):
        host[name][:n] = rows
        host[name][n:batch] = pad
    host["block_tables"][:n, :width] = block_tables
    host["block_tables"][n:batch, 0] = scratch_block
