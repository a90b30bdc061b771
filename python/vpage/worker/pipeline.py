"""One pipeline stage's part of a step: its layers over the step's micro-batches, activations
passed to the next stage as each micro-batch is done, and the logits back to the driver.

Every rank has the whole plan. The step's sequences are cut into up to ``microbatches``
consecutive ranges of about equal tokens (``micro_batches``; at most one per
``MIN_MICRO_BATCH_TOKENS`` tokens), so that stage s + 1 runs range k while stage s runs range
k + 1. Between stages travels ``[2, tokens, hidden]`` in the model's
dtype (block output and residual stream), each tensor rank to the same rank of the next stage.
The last stage computes each range's logits as soon as its layers are done (its rows of the
sampled ones; a step with extra rows, prompt scores or drafts, is one range whose logits are
the sampled rows' then the extra rows'), and its tensor rank 0 sends them to the driver, which
samples from the logits of the whole step.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from vpage.distributed import parallel_state as ps
from vpage.model_executor.forward_batch import ForwardBatch

# Fewest tokens worth a micro-batch of their own: each one reads the stage's weights again, and
# below this a decode step's matmuls are bound by those reads (bench/RESULTS-scale.md: 16 decode
# rows ran 0.79x as fast in 4 micro-batches as in one).
MIN_MICRO_BATCH_TOKENS = 32


def micro_batches(query_start_loc: np.ndarray, count: int) -> list[tuple[int, int]]:
    """Consecutive sequence ranges ``[a, b)`` covering every sequence, up to ``count`` of them:
    each cut at the sequence boundary nearest to an equal share of the tokens (a sequence is
    never split, so a long prefill chunk makes fewer ranges)."""
    num_seqs, total = len(query_start_loc) - 1, int(query_start_loc[-1])
    targets = total * np.arange(1, count) / count
    above = np.minimum(np.searchsorted(query_start_loc, targets, side="left"), num_seqs)
    below = np.maximum(above - 1, 0)
    nearer_below = targets - query_start_loc[below] < query_start_loc[above] - targets
    cuts = np.where(nearer_below, below, above)
    bounds = sorted({0, num_seqs, *(int(c) for c in cuts if 0 < c < num_seqs)})
    return list(zip(bounds[:-1], bounds[1:]))


def slice_batch(batch: ForwardBatch, query_start_loc: np.ndarray, context_lens: np.ndarray,
                a: int, b: int) -> ForwardBatch:
    """The sequences ``[a, b)`` of ``batch`` (host copies of its offsets and lengths give the
    maxima without reading the device)."""
    t0, t1 = int(query_start_loc[a]), int(query_start_loc[b])
    return dataclasses.replace(
        batch, input_ids=batch.input_ids[t0:t1], positions=batch.positions[t0:t1],
        slot_mapping=batch.slot_mapping[t0:t1], block_tables=batch.block_tables[a:b],
        context_lens=batch.context_lens[a:b], query_start_loc=batch.query_start_loc[a:b + 1] - t0,
        max_context_len=int(context_lens[a:b].max()),
        max_query_len=int(np.diff(query_start_loc[a:b + 1]).max()))


class PipelineStage:
    """This rank's place in the pipeline: who it receives activations from and sends them to."""

    def __init__(self, model: torch.nn.Module, hidden_size: int, dtype: torch.dtype, vocab_size: int,
                 device: torch.device, microbatches: int):
        self.model = model
        self.hidden_size, self.dtype, self.vocab_size, self.device = hidden_size, dtype, vocab_size, device
        self.microbatches = microbatches
        stage, stages = ps.pp_rank(), ps.pp_size()
        self.first, self.last = stage == 0, stage == stages - 1
        self.prev = None if self.first else ps.stage_rank(stage - 1)
        self.next = None if self.last else ps.stage_rank(stage + 1)
        self.is_driver = self.first and ps.tp_rank() == 0
        self.sends_logits = self.last and ps.tp_rank() == 0  # the last stage's tensor rank 0
        self.logits_source = (stages - 1) * ps.tp_size()  # its global rank
        self.num_split_steps = 0  # steps run as more than one micro-batch

    def logits(self, plan, batch: ForwardBatch, kv_caches: list,
               logit_rows: Optional[np.ndarray]) -> Optional[torch.Tensor]:
        """Runs this stage's part of ``plan`` (``batch`` its whole forward batch); on the driver
        returns the float32 logits ``[num_samples + len(logit_rows), vocab]`` the last stage
        sent, elsewhere None."""
        qsl = np.asarray(plan.query_start_loc)
        samples = np.asarray(plan.sample_token_indices)
        count = 1
        if logit_rows is None and bool(np.all(np.diff(samples) >= 0)):
            count = max(1, min(self.microbatches, int(qsl[-1]) // MIN_MICRO_BATCH_TOKENS))
        ranges = micro_batches(qsl, count)
        context_lens = np.asarray(plan.context_lens)
        self.num_split_steps += len(ranges) > 1
        pending = []  # sends in flight: (work, tensor kept alive until it is done)
        for a, b in ranges:
            part = batch if len(ranges) == 1 else slice_batch(batch, qsl, context_lens, a, b)
            t0, t1 = int(qsl[a]), int(qsl[b])
            intermediate = None
            if not self.first:
                intermediate = torch.empty(2, t1 - t0, self.hidden_size, dtype=self.dtype, device=self.device)
                ps.recv(intermediate, self.prev)
            out = self.model(part, kv_caches, intermediate)
            if not self.last:
                pending.append((ps.send(out, self.next), out))
                continue
            lo, hi = np.searchsorted(samples, [t0, t1], side="left")
            rows = samples[lo:hi] - t0
            if logit_rows is not None:
                rows = np.concatenate([rows, logit_rows])
            if not len(rows):  # no sampled row in this range (prefill chunks): nothing to send
                continue
            logits = self.model.compute_logits(out.index_select(0, torch.from_numpy(rows).to(self.device)))
            if self.sends_logits and not self.is_driver:
                pending.append((ps.send(logits, 0), logits))
        for work, _ in pending:
            work.wait()
        if not self.is_driver:
            return None
        num_rows = len(samples) + (0 if logit_rows is None else len(logit_rows))
        logits = torch.empty(num_rows, self.vocab_size, dtype=torch.float32, device=self.device)
        for a, b in ranges:
            lo, hi = np.searchsorted(samples, [int(qsl[a]), int(qsl[b])], side="left")
            if len(ranges) == 1:
                lo, hi = 0, num_rows
            if hi > lo:
                ps.recv(logits[lo:hi], self.logits_source)
        return logits
