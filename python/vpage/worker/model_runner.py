"""Turns a scheduler plan into one model forward, then samples it: the step's tokens (drafts
verified), their logprobs and the prompt rows' scores, returned as a ``ModelRunnerOutput``.

The logits of a step are one float32 tensor whose rows are, in this order: one per sampled
sequence (``plan.sample_token_indices``), then the prompt rows of prompt_logprobs requests,
then each speculating sample's draft rows. That order is known here alone
(``extra_logit_rows`` gives the rows after the sampled ones, which tensor-parallel ranks
compute too).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from vpage import _core
from vpage.lora.manager import LoRAManager
from vpage.model_executor.forward_batch import ForwardBatch
from vpage.model_executor.loader.model_loader import LoadedModel
from vpage.sampler import Sampler
from vpage.spec_decode.verifier import DraftRows
from vpage.worker.cuda_graphs import DecodeGraphs
from vpage.worker.input_staging import StepInputs
from vpage.worker.pipeline import PipelineStage
from vpage.worker.prompt_logprobs import score_prompt_rows
from vpage.worker.step_io import ModelRunnerOutput, SamplingMetadata


def per_token_queries(plan: _core.SchedulePlan) -> Optional[dict[str, np.ndarray]]:
    """For a step of decode rows some of which carry draft tokens (no prompt rows), on CUDA:
    attention metadata that makes every token its own decode query over its sequence's blocks,
    context ending at the token. The decode kernel then scores each draft position exactly as a
    non-speculative step would score that position (a prompt-shaped row would take the prefill
    kernel, whose sums round differently). The CPU kernels do the same from the plan's own rows
    (``ForwardBatch.draft_queries``). None for any other step."""
    if not has_draft_rows(plan):
        return None
    tokens_per_row = np.diff(plan.query_start_loc)
    return {
        "block_tables": np.repeat(plan.block_tables, tokens_per_row, axis=0),
        "context_lens": (plan.positions + 1).astype(np.int32),
        "query_start_loc": np.arange(len(plan.input_ids) + 1, dtype=np.int32),
    }


def extra_logit_rows(plan: _core.SchedulePlan, sampling: Optional[SamplingMetadata],
                     draft: Optional[DraftRows] = None) -> Optional[np.ndarray]:
    """The token indices whose logits a step needs after the sampled rows' (int64; None when
    none): the prompt rows to score, then the draft rows (``draft``, or the plan's own)."""
    draft = draft if draft is not None else DraftRows.of(plan)
    prompt = sampling.prompt_logprobs if sampling is not None else None
    extra = [r.rows for r in (prompt, draft) if r is not None]
    return np.concatenate(extra) if extra else None


def has_draft_rows(plan: _core.SchedulePlan) -> bool:
    """Whether the plan's rows are decode tokens some of which carry drafts (no prompt rows)."""
    return bool(plan.num_draft_tokens) and not plan.num_prefill_tokens


class ModelRunner:
    """Runs the model over a plan's flattened batch, computes logits only for the rows it
    needs, and samples them.

    On CPU the plan's flat buffers (numpy views of C++ memory) are wrapped as tensors without
    copying. On CUDA they go through ``staging`` (reused pinned buffers, asynchronous copies),
    and decode steps that fit a captured graph replay it (``graphs``; None = always eager).
    With ``lora``, each step's rows run under their adapters (``plan.lora_ids``). A pipeline
    stage's runner (``pipeline``) runs its part of the model and the driver's gets the logits.
    """

    def __init__(self, loaded: LoadedModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 staging: Optional[StepInputs] = None, graphs: Optional[DecodeGraphs] = None,
                 lora: Optional[LoRAManager] = None, pipeline: Optional[PipelineStage] = None):
        self.model = loaded.model
        self.pipeline = pipeline
        self.device = loaded.device
        self.kv_caches = kv_caches
        self.staging = staging
        self.graphs = graphs
        self.lora = lora
        self.vocab_size = loaded.config.vocab_size
        self.sampler = Sampler(loaded.config.eos_token_ids)
        self._logits: Optional[torch.Tensor] = None  # CPU: reused [rows, vocab] float32 buffer

    def _tensor(self, array) -> torch.Tensor:
        t = torch.from_numpy(array)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def _lora_token_slots(self, plan: _core.SchedulePlan) -> Optional[torch.Tensor]:
        return None if self.lora is None else self.lora.prepare_step(plan.lora_ids, plan.query_start_loc)

    def batch_of(self, plan: _core.SchedulePlan) -> ForwardBatch:
        per_token = per_token_queries(plan) if self.device.type != "cpu" else None
        lora_token_slots = self._lora_token_slots(plan)
        if per_token is not None:
            return ForwardBatch(
                input_ids=self._tensor(plan.input_ids), positions=self._tensor(plan.positions),
                slot_mapping=self._tensor(plan.slot_mapping), block_tables=self._tensor(per_token["block_tables"]),
                context_lens=self._tensor(per_token["context_lens"]),
                query_start_loc=self._tensor(per_token["query_start_loc"]),
                max_context_len=plan.max_context_len, max_query_len=1, lora_token_slots=lora_token_slots)
        return ForwardBatch(
            input_ids=self._tensor(plan.input_ids),
            positions=self._tensor(plan.positions),
            slot_mapping=self._tensor(plan.slot_mapping),
            block_tables=self._tensor(plan.block_tables),
            context_lens=self._tensor(plan.context_lens),
            query_start_loc=self._tensor(plan.query_start_loc),
            max_context_len=plan.max_context_len,
            max_query_len=plan.max_query_len,
            draft_queries=has_draft_rows(plan),
            lora_token_slots=lora_token_slots,
        )

    @torch.inference_mode()
    def execute(self, plan: _core.SchedulePlan, sampling: SamplingMetadata,
                layer_events: Optional[list] = None) -> ModelRunnerOutput:
        """Forward of the plan's tokens, then sampling, draft verification and prompt scoring
        (the driver rank's work; other ranks compute ``logits`` alone). ``layer_events``
        (CUDA): layer i's attention waits on event i (that layer's swaps)."""
        draft = DraftRows.of(plan)
        pooled = None
        if self.pipeline is not None:  # (pooling runs unpipelined)
            logits = self.logits(plan, layer_events, extra_logit_rows(plan, sampling, draft))
        else:
            hidden, rows = self._forward(plan, layer_events)
            if sampling.pooled and sampling.pooled_token_ids is None:  # a pooling request's sampled row is
                pooled = hidden.index_select(0, rows[sampling.pooled]).float().cpu()  # its last prompt token's
            logits = self._logits_of(hidden, rows, extra_logit_rows(plan, sampling, draft))
            if sampling.pooled and sampling.pooled_token_ids is not None:  # a classifier of next-token logits
                pooled = logits[sampling.pooled][:, sampling.pooled_token_ids].cpu()
        num_samples = len(sampling.rows)
        extra = logits[num_samples:]
        prompt_scores = None
        if sampling.prompt_logprobs is not None:
            num_prompt = len(sampling.prompt_logprobs.rows)
            prompt_scores = score_prompt_rows(extra[:num_prompt], sampling.prompt_logprobs)
            extra = extra[num_prompt:]
        if draft is None:
            sampled = self.sampler.sample(logits[:num_samples], sampling.rows, sampling.token_bitmask)
            runs, num_drafts, num_accepted = [(i, 1) for i in range(num_samples)], [], []
        else:
            verified = draft.verify(self.sampler, logits[:num_samples], extra, sampling.rows, sampling.token_bitmask)
            sampled, runs = verified.sampled, verified.runs
            num_drafts, num_accepted = verified.num_drafts, verified.num_accepted
        return ModelRunnerOutput(sampled.token_ids.tolist(), sampled.logprobs.tolist(), sampled.top_logprobs, runs,
                                 num_drafts, num_accepted, prompt_scores, pooled)

    def logits(self, plan: _core.SchedulePlan, layer_events: Optional[list] = None,
               logit_rows: Optional[np.ndarray] = None) -> Optional[torch.Tensor]:
        """Forward of the plan's tokens; float32 logits ``[num_samples + len(logit_rows), vocab]``:
        the sampled rows', then those of ``logit_rows`` (int64 token indices). A pipeline stage
        runs its part and returns None (the driver's ``execute`` gets the logits)."""
        if self.pipeline is not None:
            return self.pipeline.logits(plan, self._pipeline_batch(plan, layer_events), self.kv_caches, logit_rows)
        hidden, rows = self._forward(plan, layer_events)
        return self._logits_of(hidden, rows, logit_rows)

    def _forward(self, plan: _core.SchedulePlan, layer_events: Optional[list]) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states of the plan's tokens, and the token indices of its samples."""
        if self.staging is None:
            return self.model(self.batch_of(plan), self.kv_caches), self._tensor(plan.sample_token_indices)
        return self._execute_staged(plan, layer_events)

    def _logits_of(self, hidden: torch.Tensor, rows: torch.Tensor, logit_rows: Optional[np.ndarray]) -> torch.Tensor:
        """Float32 logits of the sampled ``rows``, then of ``logit_rows`` (int64 token indices)."""
        if logit_rows is None:
            return self.model.compute_logits(hidden.index_select(0, rows), self._logits_buffer(rows.shape[0]))
        # Up to a whole chunk of rows, rarely: a fresh tensor, not the kept buffer grown for good.
        rows = torch.cat([rows, self._tensor(logit_rows)])
        return self.model.compute_logits(hidden.index_select(0, rows))

    def _logits_buffer(self, rows: int) -> Optional[torch.Tensor]:
        """On the CPU, the first ``rows`` rows of a float32 logits buffer kept across steps (grown
        to the largest batch seen): at 256 rows x 49,152 tokens, allocating, faulting in and
        freeing a fresh one cost ~15 ms a step. The logits of a step are dead once it is
        sampled, before the next step writes them. None elsewhere."""
        if self.device.type != "cpu":
            return None
        if self._logits is None or self._logits.shape[0] < rows:
            self._logits = torch.empty(rows, self.vocab_size, dtype=torch.float32)
        return self._logits[:rows]

    def _execute_staged(self, plan, layer_events: Optional[list]) -> tuple[torch.Tensor, torch.Tensor]:
        if has_draft_rows(plan):  # draft tokens: eager, each token its own query
            batch = self.batch_of(plan)
            batch.layer_events = layer_events
            return self.model(batch, self.kv_caches), self._tensor(plan.sample_token_indices)
        graph_rows = self.graphs.batch_size_for(plan) if self.graphs is not None else None
        if graph_rows is not None:
            if layer_events is not None:  # a captured graph cannot wait per layer: wait for all swaps
                torch.cuda.current_stream(self.device).wait_event(layer_events[-1])
            rows = self.staging.upload(plan, ["sample_token_indices"])["sample_token_indices"]
            return self.graphs.run(plan, graph_rows), rows
        batch, rows = self._staged_batch(plan, layer_events)
        return self.model(batch, self.kv_caches), rows

    def _staged_batch(self, plan, layer_events: Optional[list]) -> tuple[ForwardBatch, torch.Tensor]:
        """The plan's batch uploaded through ``staging``, and its sampled token indices."""
        inputs = self.staging.upload(plan)
        batch = ForwardBatch(
            input_ids=inputs["input_ids"], positions=inputs["positions"], slot_mapping=inputs["slot_mapping"],
            block_tables=inputs["block_tables"], context_lens=inputs["context_lens"],
            query_start_loc=inputs["query_start_loc"], max_context_len=plan.max_context_len,
            max_query_len=plan.max_query_len, layer_events=layer_events,
            lora_token_slots=self._lora_token_slots(plan))
        return batch, inputs["sample_token_indices"]

    def _pipeline_batch(self, plan, layer_events: Optional[list]) -> ForwardBatch:
        """The whole batch of a pipeline stage's step. The stage's swaps are awaited at once (the
        attention's per-layer waits index the whole model's layers)."""
        if layer_events is not None:
            torch.cuda.current_stream(self.device).wait_event(layer_events[-1])
        if self.staging is None or has_draft_rows(plan):
            return self.batch_of(plan)
        return self._staged_batch(plan, None)[0]
