"""One pipeline stage's part of a step: its layers over the step's micro-batches, activations
passed on as each micro-batch is done, and the logits back to the driver.

Every rank has the whole plan. The step's sequences are cut into up to ``microbatches``
consecutive ranges of about equal tokens (``micro_batches``; at most one per
``MIN_MICRO_BATCH_TOKENS`` tokens). The model's layers are cut into virtual stages, stage s
holding virtual stages s, s + S, s + 2S, ... of S stages (interleaved, as Megatron-LM's
schedule does: with v ranges per stage the pipeline fills and drains in 1/v of a stage's
time). Each stage runs its ranges in order, every micro-batch through a range before the next
range, so that while it runs micro-batch k the next stage runs micro-batch k - 1. Between
virtual stages travels ``[2, tokens, hidden]`` in the model's dtype (block output and residual
stream), each tensor rank to the same rank of the next stage (the last stage's to the first).
The last virtual stage computes each micro-batch's logits as soon as its layers are done (its
rows of the sampled ones; a step with extra rows, prompt scores or drafts, is one micro-batch
whose logits are the sampled rows' then the extra rows'), and its tensor rank 0 sends them to
the driver under their own tag, into receives the driver posts before its own work; the
driver samples from the logits of the whole step. Activations between two ranks are received
in the order they were sent, which this order of work keeps.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np
import torch

from vpage.distributed import parallel_state as ps
from vpage.model_executor.forward_batch import ForwardBatch

LOGITS_TAG = 1  # logits to the driver: received as they come, apart from the activations (tag 0)

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
        # Virtual stage j (of stages x ranges) runs on stage j % stages: this stage runs
        # j = stage + r * stages for each of its layer ranges r, from and to its neighbours.
        self.virtual = [stage + r * stages for r in range(ps.virtual_stages())]
        self.num_virtual = stages * ps.virtual_stages()
        self.prev = ps.stage_rank((stage - 1) % stages)
        self.next = ps.stage_rank((stage + 1) % stages)
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
        # gloo keeps tags apart, so the logits' receives go first; NCCL matches a pair's
        # messages in order whatever their tag, so there they follow the activations'.
        early = self.is_driver and self.device.type == "cpu"
        logits, receiving = self._start_logits_recv(samples, qsl, ranges, logit_rows) if early else (None, [])
        parts = [batch] if len(ranges) == 1 else [slice_batch(batch, qsl, context_lens, a, b) for a, b in ranges]
        for layer_range, j in enumerate(self.virtual):
            for (a, b), part in zip(ranges, parts):
                out = self._run_range(part, kv_caches, layer_range, j, int(qsl[b]) - int(qsl[a]))
                if j < self.num_virtual - 1:
                    pending.append((ps.send(out, self.next), out))
                    continue
                self._send_logits(out, samples, int(qsl[a]), int(qsl[b]), logit_rows, pending)
        for work, _ in pending:
            work.wait()
        if self.is_driver and not early:
            logits, receiving = self._start_logits_recv(samples, qsl, ranges, logit_rows)
        start = time.perf_counter()
        for work in receiving:
            work.wait()
        ps.COMM_TIME.send_recv += time.perf_counter() - start
        return logits

    def _start_logits_recv(self, samples: np.ndarray, qsl: np.ndarray, ranges: list[tuple[int, int]],
                           logit_rows: Optional[np.ndarray]) -> tuple[torch.Tensor, list]:
        """The driver's logits buffer ``[num_samples + len(logit_rows), vocab]`` float32, and the
        receives of each micro-batch's rows into it, posted before the step's work so that the
        logits arrive while the driver computes."""
        num_rows = len(samples) + (0 if logit_rows is None else len(logit_rows))
        logits = torch.empty(num_rows, self.vocab_size, dtype=torch.float32, device=self.device)
        if len(ranges) == 1:
            return logits, [ps.start_recv(logits, self.logits_source, LOGITS_TAG)] if num_rows else []
        receiving = []
        for a, b in ranges:
            lo, hi = np.searchsorted(samples, [int(qsl[a]), int(qsl[b])], side="left")
            if hi > lo:
                receiving.append(ps.start_recv(logits[lo:hi], self.logits_source, LOGITS_TAG))
        return logits, receiving

    def _run_range(self, part: ForwardBatch, kv_caches: list, layer_range: int, virtual: int,
                   num_tokens: int) -> torch.Tensor:
        """This stage's ``layer_range`` over one micro-batch (virtual stage ``virtual``)."""
        intermediate = None
        if virtual > 0:
            intermediate = torch.empty(2, num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
            ps.recv(intermediate, self.prev)
        return self.model(part, kv_caches, intermediate, layer_range)

    def _send_logits(self, hidden: torch.Tensor, samples: np.ndarray, t0: int, t1: int,
                     logit_rows: Optional[np.ndarray], pending: list) -> None:
        """The logits of the sampled rows among tokens ``[t0, t1)`` (then ``logit_rows``), sent
        to the driver by the last stage's tensor rank 0 (nothing when the range samples none)."""
        lo, hi = np.searchsorted(samples, [t0, t1], side="left")
        rows = samples[lo:hi] - t0
        if logit_rows is not None:
            rows = np.concatenate([rows, logit_rows])
        if not len(rows):  # no sampled row in this range (prefill chunks): nothing to send
            return
        logits = self.model.compute_logits(hidden.index_select(0, torch.from_numpy(rows).to(self.device)))
        if self.sends_logits:
            pending.append((ps.send(logits, 0, LOGITS_TAG), logits))
