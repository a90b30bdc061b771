"""Turns a scheduler plan into one model forward and the logits of the rows to sample."""

from __future__ import annotations

import torch

from vpage import _core
from vpage.model_executor.forward_batch import ForwardBatch
from vpage.model_executor.loader.model_loader import LoadedModel


class ModelRunner:
    """Wraps the plan's flat buffers (numpy views of C++ memory) as tensors without copying on
    CPU, runs the model over the flattened batch and computes logits only for sampled rows."""

    def __init__(self, loaded: LoadedModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.model = loaded.model
        self.device = loaded.device
        self.kv_caches = kv_caches

    def _tensor(self, array) -> torch.Tensor:
        t = torch.from_numpy(array)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def batch_of(self, plan: _core.SchedulePlan) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self._tensor(plan.input_ids),
            positions=self._tensor(plan.positions),
            slot_mapping=self._tensor(plan.slot_mapping),
            block_tables=self._tensor(plan.block_tables),
            context_lens=self._tensor(plan.context_lens),
            query_start_loc=self._tensor(plan.query_start_loc),
            max_context_len=plan.max_context_len,
            max_query_len=plan.max_query_len,
        )

    @torch.inference_mode()
    def execute(self, plan: _core.SchedulePlan) -> torch.Tensor:
        """Forward of the plan's tokens; returns float32 logits ``[num_samples, vocab]``."""
        hidden = self.model(self.batch_of(plan), self.kv_caches)
        rows = self._tensor(plan.sample_token_indices)
        return self.model.compute_logits(hidden.index_select(0, rows))
