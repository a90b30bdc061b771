"""Verification of draft tokens (speculative decoding): which drafts a step's forward accepts.

The C++ scheduler puts a speculating sequence's d draft tokens after its last token in one
row, so the forward yields logits for d + 1 positions: the one after the last token, then one
after each draft. Every position is sampled as it would be without speculation (its own
penalties, min_tokens ban and generator draw, the drafts before it counted as output), and the
drafts are accepted while each equals the token sampled at its position; the first sampled
token that differs, or the one after the last draft, is the verified token that ends the run.

This is rejection sampling with deterministic drafts (n-gram lookup proposes one token, q is
one-hot): a draft d is kept with probability p(d) = min(1, p(d) / q(d)), and a rejected
position's token is drawn from p without d, the normalised residual max(p - q, 0). So the
output has exactly the distribution of non-speculative sampling; greedy output is the same
token for token, and a seeded request's generator is rewound to the draws of the tokens it
kept, so seeded output is the same too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from vpage import _core
from vpage.sampler import Sampler, SamplerOutput, SamplingRow, SamplingType, draw_uniform


@dataclass
class Verified:
    """Sampled tokens of every position and, per sample, the rows it commits: ``runs[i] =
    (first row, number of rows)``, the accepted drafts followed by the verified token;
    ``num_drafts[i]`` and ``num_accepted[i]``: the sample's drafts and how many were kept."""

    sampled: SamplerOutput
    runs: list[tuple[int, int]]
    num_drafts: list[int]
    num_accepted: list[int]


class DraftRows:
    """The draft-carrying samples of one plan and the logits rows they need."""

    def __init__(self, plan: _core.SchedulePlan):
        self.num_drafts = plan.sample_num_drafts.tolist()
        last = plan.sample_token_indices.tolist()
        input_ids = plan.input_ids
        self.drafts = [input_ids[i - d + 1: i + 1].tolist() if d else [] for i, d in zip(last, self.num_drafts)]
        # Logits of the positions before each sample's last: [index - d, index).
        rows = [np.arange(i - d, i, dtype=np.int64) for i, d in zip(last, self.num_drafts) if d]
        self.rows = np.concatenate(rows)

    @staticmethod
    def of(plan: _core.SchedulePlan) -> Optional["DraftRows"]:
        """The plan's draft rows, or None when no sample carries drafts."""
        return DraftRows(plan) if plan.num_draft_tokens else None

    def verify(self, sampler: Sampler, last_logits: torch.Tensor, draft_logits: torch.Tensor,
               rows: list[SamplingRow], token_bitmask: Optional[torch.Tensor]) -> Verified:
        """Samples every position and accepts drafts. ``last_logits`` ``[num_samples, vocab]``:
        each sample's last row; ``draft_logits`` ``[len(self.rows), vocab]``: the rows before
        them, in ``self.rows`` order; ``rows``: the samples' sampling rows (a draft position
        counts the drafts before it as output: penalties, the min_tokens rule)."""
        order: list[int] = []  # into cat(last_logits, draft_logits)
        expanded: list[SamplingRow] = []
        runs_start: list[int] = []
        num_samples, next_draft = len(rows), 0
        saved: dict[int, torch.Tensor] = {}  # sample -> its generator's state before sampling
        for i, (row, drafts) in enumerate(zip(rows, self.drafts)):
            runs_start.append(len(order))
            if not drafts:
                order.append(i)
                expanded.append(row)
                continue
            order.extend(range(num_samples + next_draft, num_samples + next_draft + len(drafts)))
            order.append(i)
            next_draft += len(drafts)
            for j in range(len(drafts) + 1):
                outputs = list(row.output_token_ids) + drafts[:j]
                expanded.append(SamplingRow(row.params, row.prompt_token_ids, outputs, row.generator,
                                            row.banned_token_ids))
            if row.generator is not None and row.params.sampling_type == SamplingType.RANDOM_SEED:
                saved[i] = row.generator.get_state()
        logits = torch.cat([last_logits, draft_logits]).index_select(0, torch.tensor(order, device=last_logits.device))
        if token_bitmask is not None:
            sample_of = [i for i, drafts in enumerate(self.drafts) for _ in range(len(drafts) + 1)]
            token_bitmask = token_bitmask.index_select(0, torch.tensor(sample_of, device=token_bitmask.device))
        sampled = sampler.sample(logits, expanded, token_bitmask)
        tokens = sampled.token_ids.tolist()
        runs, num_accepted = [], []
        for i, (start, drafts) in enumerate(zip(runs_start, self.drafts)):
            accepted = 0
            while accepted < len(drafts) and tokens[start + accepted] == drafts[accepted]:
                accepted += 1
            runs.append((start, accepted + 1))
            num_accepted.append(accepted)
            if i in saved:
                _rewind(rows[i].generator, saved[i], accepted + 1, logits.device)
        return Verified(sampled, runs, self.num_drafts, num_accepted)


def _rewind(generator: torch.Generator, state: torch.Tensor, draws: int, device) -> None:
    """Leaves ``generator`` as if only ``draws`` positions had been sampled (one uniform number
    each, as the sampler draws them)."""
    generator.set_state(state)
    for _ in range(draws):
        draw_uniform(generator, device)
