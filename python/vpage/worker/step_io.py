"""What crosses between the engine and the model runner in one step, besides the plan.

In: ``SamplingMetadata`` (per sampled sequence its sampling row, the grammar bitmask, the
prompt rows to score) and, for a draft model, a ``DraftRequest``. Out: ``ModelRunnerOutput``,
numbers only (token ids, logprobs, accepted drafts, prompt logprob scores, the hidden states
that pooling requests asked for): no logits tensor leaves the model runner. Under tensor parallelism the driver rank's output is the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from vpage.sampler import SamplingRow
from vpage.spec_decode.draft_runner import DraftInputs
from vpage.worker.prompt_logprobs import PromptLogprobRows, PromptScores


@dataclass
class SamplingMetadata:
    """How to sample a step: ``rows[i]`` is the sampling row of the plan's i-th sampled
    sequence (``plan.sample_seq_ids`` order: parameters, tokens so far for penalties and the
    min_tokens rule, its generator); ``token_bitmask`` (int32 ``[len(rows), words]``, all ones
    for free rows) the structured-output constraint of each; ``prompt_logprobs`` the prompt
    rows to score."""

    rows: list[SamplingRow]
    token_bitmask: Optional[torch.Tensor] = None
    prompt_logprobs: Optional[PromptLogprobRows] = None
    # Pooling requests: the samples (indices into ``rows``) whose final hidden state (the last
    # prompt token's, when their prefill ends) is returned in ``ModelRunnerOutput.pooled``.
    pooled: Optional[list[int]] = None
    # A token classifier's class token ids: its samples return those logits, not the hidden state.
    pooled_token_ids: Optional[list[int]] = None


@dataclass
class DraftRequest:
    """The draft model's work in a step: ``inputs`` for the driver's draft runner, and ``fill``,
    which writes its drafts into the plan (the scheduler's ``fill_drafts``) before the forward."""

    inputs: DraftInputs
    fill: Callable[[np.ndarray], None]


@dataclass
class ModelRunnerOutput:
    """A step's results. Tokens are listed sample after sample, in plan order: each sample's
    accepted drafts, then its sampled token; ``runs[i] = (first, count)`` locates sample i's."""

    token_ids: list[int]
    logprobs: list[float]  # per token, under the model's own distribution; NaN where none was asked for
    top_logprobs: list[Optional[list[tuple[int, float]]]]  # per token, (id, logprob) best first, when asked
    runs: list[tuple[int, int]]
    # Speculative decoding, per sample: drafts it carried and how many were accepted (empty without).
    num_drafts: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    prompt_logprobs: Optional[PromptScores] = None
    # float32 [len(SamplingMetadata.pooled), hidden_size] (or [.., len(pooled_token_ids)]: logits), on the CPU
    pooled: Optional[torch.Tensor] = None
