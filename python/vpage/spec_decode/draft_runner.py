"""Runs the draft model of speculative decoding: greedy draft tokens for the rows of a plan.

The draft model keeps its own KV cache in the target's block ids (the same block tables and
slots; the cache engine applies every block operation to both). ``DraftInputs`` (built by the
engine, which knows each sequence's tokens) says what the draft has not computed yet for each
drafting sequence: one catch-up forward computes those tokens and drafts the first token from
the last of them, then one decode forward per further draft position feeds the previous draft.

A draft that is the target in another form (the same architecture and shape: a quantized copy,
on one rank, the target's KV dtype its own) reads and writes the target's own KV cache instead
(``shares_target_kv``): before a step's target forward, every position before its row holds
the target's K/V, so the catch-up needs only the row's own real tokens
(``DraftInputs.from_row_starts``), never a prompt; what the draft writes at the row's positions
the target's forward overwrites before it reads them.
Drafts are only proposals, so the K/V they are computed from changes their quality, never the
output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from vpage.model_executor.forward_batch import ForwardBatch
from vpage.model_executor.loader.model_loader import LoadedModel


@dataclass
class DraftInputs:
    """The draft's work in one step, for the plan's drafting samples in order (numpy arrays).

    Catch-up rows (one per drafting sample): the tokens the draft has not computed up to the
    sample's last real token, at their positions and slots. Then sample i drafts
    ``num_drafts[i]`` tokens at positions ``last_position[i] + 1 ...`` in the blocks of
    ``block_tables[i]``."""

    input_ids: np.ndarray  # [n] int64
    positions: np.ndarray  # [n] int64
    slot_mapping: np.ndarray  # [n] int64
    query_start_loc: np.ndarray  # [rows + 1] int32
    block_tables: np.ndarray  # [rows, max_blocks] int32
    num_drafts: np.ndarray  # [rows] int32, >= 1
    row_starts: np.ndarray  # [rows] int64: the first position of each sample's row in the plan

    @property
    def last_position(self) -> np.ndarray:
        return self.positions[self.query_start_loc[1:] - 1]

    def from_row_starts(self) -> "DraftInputs":
        """The catch-up rows cut to the plan rows' own positions (each keeps at least its last
        real token): what remains to compute when the K/V before the rows is the target's."""
        rows = len(self.query_start_loc) - 1
        row_of = np.repeat(np.arange(rows), np.diff(self.query_start_loc))
        keep = self.positions >= self.row_starts[row_of]
        counts = np.bincount(row_of[keep], minlength=rows)
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        return dataclasses.replace(self, input_ids=self.input_ids[keep], positions=self.positions[keep],
                                   slot_mapping=self.slot_mapping[keep], query_start_loc=starts)


_SHARED_SHAPE = ("architecture", "num_layers", "num_heads", "num_kv_heads", "head_size", "hidden_size",
                 "vocab_size", "max_model_len")
_SHARED_HF = ("rope_theta", "rope_scaling", "sliding_window", "rms_norm_eps")


def shares_target_kv(target: LoadedModel, draft: LoadedModel, tp_size: int, kv_cache_dtype: torch.dtype) -> bool:
    """Whether the draft is the target in another form (architecture, shape and position
    encoding alike, one rank) and the target's KV cache (of ``kv_cache_dtype``) is what the
    draft's own would be (its activations' dtype), so that it can read that cache (see above)."""
    return (tp_size == 1 and target.device == draft.device and kv_cache_dtype == draft.config.dtype
            and all(getattr(target.config, f) == getattr(draft.config, f) for f in _SHARED_SHAPE)
            and all(getattr(target.hf_config, f, None) == getattr(draft.hf_config, f, None) for f in _SHARED_HF))


class DraftRunner:
    """The draft model and its KV caches on one worker."""

    def __init__(self, loaded: LoadedModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int):
        self.model = loaded.model
        self.device = loaded.device
        self.kv_caches = kv_caches
        self.block_size = block_size

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def _greedy(self, batch: ForwardBatch, rows: Optional[np.ndarray]) -> np.ndarray:
        hidden = self.model(batch, self.kv_caches)
        if rows is not None:
            hidden = hidden.index_select(0, self._tensor(rows))
        return self.model.compute_logits(hidden).argmax(dim=-1).cpu().numpy()

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs) -> np.ndarray:
        """Greedy drafts, ``num_drafts[i]`` for row i, concatenated in row order ([sum] int32)."""
        qsl = inputs.query_start_loc
        rows = len(qsl) - 1
        lengths = np.diff(qsl)
        context = inputs.last_position + 1
        catch_up = ForwardBatch(
            input_ids=self._tensor(inputs.input_ids), positions=self._tensor(inputs.positions),
            slot_mapping=self._tensor(inputs.slot_mapping), block_tables=self._tensor(inputs.block_tables),
            context_lens=self._tensor(context.astype(np.int32)), query_start_loc=self._tensor(qsl),
            max_context_len=int(context.max()), max_query_len=int(lengths.max()))
        most = int(inputs.num_drafts.max())
        drafts = np.zeros((rows, most), dtype=np.int64)
        drafts[:, 0] = self._greedy(catch_up, (qsl[1:] - 1).astype(np.int64))
        bs = self.block_size
        for j in range(1, most):
            active = np.flatnonzero(inputs.num_drafts > j)
            positions = inputs.last_position[active] + j  # where draft j - 1 (0-based) goes
            tables = inputs.block_tables[active]
            slots = tables[np.arange(len(active)), positions // bs].astype(np.int64) * bs + positions % bs
            batch = ForwardBatch(
                input_ids=self._tensor(drafts[active, j - 1]), positions=self._tensor(positions),
                slot_mapping=self._tensor(slots), block_tables=self._tensor(tables),
                context_lens=self._tensor((positions + 1).astype(np.int32)),
                query_start_loc=self._tensor(np.arange(len(active) + 1, dtype=np.int32)),
                max_context_len=int(positions.max()) + 1, max_query_len=1)
            drafts[active, j] = self._greedy(batch, None)
        return np.concatenate([drafts[i, :d] for i, d in enumerate(inputs.num_drafts.tolist())]).astype(np.int32)
