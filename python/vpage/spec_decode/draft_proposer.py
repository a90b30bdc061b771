"""What the draft model of speculative decoding computes in a step (the engine's side).

The draft model's KV cache lives in the target's blocks, but it is not always as far along:
it drafted from the last real token of each drafting sequence, so after a run of all drafts
accepted it lacks the last draft's K/V, and after a preemption by recompute (or with a prefix
cache hit) it may lack a whole prefix. The engine, which holds every sequence's tokens, tracks
how far the draft's K/V reaches per sequence and hands the worker exactly the tokens to catch
up on. Every row of every step bounds that reach by where the row starts (a recompute starts
again at 0, in blocks that may now hold anything); rejected drafts' slots lie past the next
row's start, so they need nothing more. Each sample's row start goes along too: a draft that
reads the target's KV cache catches up only from there (draft_runner.py).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from vpage import _core
from vpage.spec_decode.draft_runner import DraftInputs


class DraftModelProposer:
    """Per sequence, the positions [0, n) whose draft K/V is valid (a bound: the target's
    computed tokens bound it too)."""

    def __init__(self, block_size: int, max_tracked: int):
        self.block_size = block_size
        self.max_tracked = max_tracked
        self.computed: dict[int, int] = {}

    def observe(self, plan: _core.SchedulePlan) -> None:
        """Every step: no sequence's draft K/V reaches past the start of its row (the target
        computes from there, so nothing after it is known to be valid)."""
        if not self.computed or not plan.num_seqs:
            return
        starts = plan.positions[plan.query_start_loc[:-1]].tolist()
        for seq_id, start in zip(plan.seq_ids.tolist(), starts):
            if self.computed.get(seq_id, 0) > start:
                self.computed[seq_id] = start

    def inputs(self, plan: _core.SchedulePlan, tokens_of: Callable[[int], list[int]]) -> DraftInputs:
        """The draft's catch-up rows for the plan's drafting samples, in sample order."""
        bs = self.block_size
        row_of = {seq_id: r for r, seq_id in enumerate(plan.seq_ids.tolist())}
        qsl, positions, tables = plan.query_start_loc, plan.positions, plan.block_tables
        ids, pos, slots, starts, rows, drafts, firsts = [], [], [], [0], [], [], []
        for seq_id, d in zip(plan.sample_seq_ids.tolist(), plan.sample_num_drafts.tolist()):
            if not d:
                continue
            r = row_of[seq_id]
            first = int(positions[qsl[r]])
            real_end = first + int(qsl[r + 1] - qsl[r]) - d  # the row's tokens before its drafts
            start = self.computed.get(seq_id, 0)  # observe() bounded it by `first`
            span = np.arange(start, real_end, dtype=np.int64)
            ids.append(np.asarray(tokens_of(seq_id)[start:real_end], dtype=np.int64))
            pos.append(span)
            slots.append(tables[r, span // bs].astype(np.int64) * bs + span % bs)
            starts.append(starts[-1] + len(span))
            rows.append(r)
            drafts.append(d)
            firsts.append(first)
            # The draft writes the K/V of the last real token and of every draft but the last.
            self.computed[seq_id] = real_end + d - 1
        if len(self.computed) > self.max_tracked:  # finished sequences: keep those running now
            self.computed = {s: n for s, n in self.computed.items() if s in row_of}
        return DraftInputs(input_ids=np.concatenate(ids), positions=np.concatenate(pos),
                           slot_mapping=np.concatenate(slots), query_start_loc=np.array(starts, dtype=np.int32),
                           block_tables=np.ascontiguousarray(tables[rows]),
                           num_drafts=np.array(drafts, dtype=np.int32), row_starts=np.array(firsts, dtype=np.int64))
