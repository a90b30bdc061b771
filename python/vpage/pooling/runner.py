"""One pooling step on the device: pack the batch, one forward, pool, and each request's vector
(embedding, class probabilities or score) as its parameters ask."""

from __future__ import annotations

import torch

from vpage.pooling.batch import PackedBatch
from vpage.pooling.loader import LoadedPoolingModel
from vpage.pooling.pooler import classification_activation, embedding, pool, pooled_rows, score_activation
from vpage.pooling.scheduler import PoolingRequest


class PoolingRunner:
    def __init__(self, loaded: LoadedPoolingModel):
        self.model = loaded.model
        self.device = loaded.device
        self.pooler = loaded.pooler
        self.classifies = loaded.num_labels is not None
        if self.classifies:
            self.activations = {"classify": classification_activation(loaded.hf_config),
                                "score": score_activation(loaded.hf_config)}

    @torch.inference_mode()
    def execute(self, requests: list[PoolingRequest]) -> list[torch.Tensor]:
        """Per request, float32 ``[n]`` on the CPU: an embedding (``dimensions`` long when
        set), class probabilities (logits with ``use_activation=False``), or a score ``[1]``."""
        batch = PackedBatch.pack([r.prompt_token_ids for r in requests], [r.token_type_ids for r in requests],
                                 self.device)
        hidden = self.model(batch, pooled_rows(self.pooler.pooling_type, batch))
        if self.classifies:
            if self.pooler.pooling_type == "MEAN":  # a head on the mean of each sequence's tokens
                hidden = pool(hidden, batch, "MEAN").to(hidden.dtype)
            logits = self.model.classify(hidden).cpu()
            return [logits[i] if r.params.use_activation is False else self.activations[r.params.task](logits[i])
                    for i, r in enumerate(requests)]
        pooled = pool(hidden, batch, self.pooler.pooling_type).cpu()
        return [embedding(pooled[i], r.params.dimensions,
                          self.pooler.normalize if r.params.normalize is None else r.params.normalize)
                for i, r in enumerate(requests)]
