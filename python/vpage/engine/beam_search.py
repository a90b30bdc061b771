"""Beam search over the engine's sequences, with transformers' semantics.

Each step every running beam offers its top candidates (token, cumulative logprob); the best
``width`` candidates that do not end (EOS or max_tokens) become the next beams, and ending
candidates among the best ``width`` are kept as finished hypotheses, scored by
``cumulative_logprob / generated_len ** length_penalty``. Stopping follows transformers'
``early_stopping``: True stops once ``width`` hypotheses are finished; False (default) once
the best running beam, scored at its current length, cannot beat the worst kept hypothesis;
"never" scores it at max_tokens when length_penalty > 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union


@dataclass
class BeamHypothesis:
    """A finished beam."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float  # length-penalised
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class BeamCandidate:
    """A running beam extended by one token."""

    parent: int  # index into the beams passed to advance()
    token: int
    cumulative_logprob: float


class BeamSearch:
    """The beam bookkeeping of one request (the engine owns the sequences and blocks)."""

    def __init__(self, width: int, length_penalty: float, early_stopping: Union[bool, str], max_tokens: int,
                 eos_token_ids: Sequence[int], num_candidates: int):
        self.width = width
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_tokens = max_tokens
        self.eos_token_ids = set(eos_token_ids)
        self.num_candidates = num_candidates
        self.finished: list[BeamHypothesis] = []  # best first, at most `width`
        self.improvable = True  # transformers' "early stop heuristic unsatisfied"
        self.num_generated = 0

    def _score(self, cumulative: float, length: int) -> float:
        return cumulative / (length ** self.length_penalty)

    def advance(self, beams: Sequence[tuple[Sequence[int], float, Sequence[tuple[int, float]]]],
                first_step: bool) -> tuple[list[BeamCandidate], bool]:
        """beams: per running beam (output token ids, cumulative logprob, top (token, logprob)
        candidates, best first). On the first step all beams are the same prompt, so only the
        first one offers candidates. Returns the next beams (best first) and whether the
        search is done."""
        candidates = [BeamCandidate(i, token, cum + lp)
                      for i, (_, cum, top) in enumerate(beams[:1] if first_step else beams)
                      for token, lp in top]
        candidates.sort(key=lambda c: c.cumulative_logprob, reverse=True)
        candidates = candidates[: self.num_candidates]
        self.num_generated += 1
        length = self.num_generated
        running: list[BeamCandidate] = []
        new_finished: list[BeamHypothesis] = []
        full = len(self.finished) == self.width and self.early_stopping is True
        for rank, c in enumerate(candidates):
            eos = c.token in self.eos_token_ids
            if not eos and length < self.max_tokens:
                if len(running) < self.width:
                    running.append(c)
                continue
            if rank < self.width and self.improvable and not full:
                new_finished.append(BeamHypothesis([*beams[c.parent][0], c.token], c.cumulative_logprob,
                                                   self._score(c.cumulative_logprob, length),
                                                   "stop" if eos else "length"))
        self.finished = sorted(self.finished + new_finished, key=lambda h: h.score, reverse=True)[: self.width]
        if running and len(self.finished) == self.width:
            hypothetical = self.max_tokens if self.early_stopping == "never" and self.length_penalty > 0 else length
            best_possible = self._score(running[0].cumulative_logprob, hypothetical)
            self.improvable = self.improvable and best_possible > self.finished[-1].score
        done = (not running or not self.improvable
                or (len(self.finished) == self.width and self.early_stopping is True))
        return running, done

    def best(self, n: int) -> list[BeamHypothesis]:
        return self.finished[:n]
