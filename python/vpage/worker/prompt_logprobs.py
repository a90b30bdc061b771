"""The model runner's side of prompt logprobs: the log-softmax of prompt rows' logits, reduced
to numbers (the prompt token's logprob and rank, and the best tokens). The engine knows whose
rows they are and turns the scores into each request's ``prompt_logprobs``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PromptLogprobRows:
    """Prompt rows a step scores: ``rows`` (int64 token indices of the plan), the prompt token
    each scores (``targets``, int64) and how many top tokens each wants (``num_top``, int64)."""

    rows: np.ndarray
    targets: np.ndarray
    num_top: np.ndarray


@dataclass
class PromptScores:
    """Per scored row: the prompt token's logprob and rank (1 + the tokens with a strictly
    higher logprob), and its ``num_top`` best tokens with their logprobs, best first."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@torch.inference_mode()
def score_prompt_rows(logits: torch.Tensor, rows: PromptLogprobRows) -> PromptScores:
    """Scores ``logits`` ``[len(rows.rows), vocab]`` (log-softmax in float32)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    own = logprobs.gather(1, torch.from_numpy(rows.targets).to(logprobs.device)[:, None])
    ranks = ((logprobs > own).sum(dim=-1) + 1).tolist()
    wants = rows.num_top.tolist()
    k = min(max(wants), logprobs.shape[1])
    if k:
        top_values, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    else:
        top_values = top_ids = [[] for _ in wants]
    return PromptScores(own[:, 0].tolist(), ranks, [ids[:w] for ids, w in zip(top_ids, wants)],
                        [values[:w] for values, w in zip(top_values, wants)])
