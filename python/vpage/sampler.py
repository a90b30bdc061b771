"""Turns the logits of a step into tokens: penalties, temperature, top-k/p, min-p, seeds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from vpage import ops
from vpage.sampling_params import SamplingParams, SamplingType


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None  # required for seeded requests (see make_generator)
    # Tokens this row may not pick now, besides the min_tokens rule's (which the sampler applies).
    banned_token_ids: Sequence[int] = ()


@dataclass
class SamplerOutput:
    """Result of one ``Sampler.sample`` call over n rows.

    Log-probabilities are those of the model's own distribution (log-softmax of the raw
    logits, before penalties, temperature and truncation), as beam search needs.
    """

    token_ids: torch.Tensor  # [n] int64, the chosen tokens
    # [n] float32, log-probability of each chosen token; NaN for rows that need none
    # (``needs_logprob``: the sampler skips their log-normaliser)
    logprobs: torch.Tensor
    # Per row: the top (token id, logprob) pairs, best first, when the row asked for them
    # (``params.logprobs``; beam rows get beam_candidates(best_of) candidates), else None.
    top_logprobs: list[list[tuple[int, float]] | None]


def needs_logprob(params: SamplingParams) -> bool:
    """Whether a request's chosen tokens need their log-probabilities: it asked for logprobs,
    or ranks its sequences by them (beam search, best_of > n). Others report no
    cumulative_logprob, as in vLLM."""
    return params.logprobs is not None or params.use_beam_search or params.best_of > params.n


def min_tokens_ban(params: SamplingParams, num_outputs: int, eos_token_ids: Sequence[int]) -> list[int]:
    """The tokens a sample with ``num_outputs`` outputs may not pick next (the min_tokens rule):
    its stop token ids and, unless ignore_eos, the EOS tokens, until it has min_tokens outputs."""
    if num_outputs >= params.min_tokens:
        return []
    return list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))


def beam_candidates(width: int, eos_token_ids: Sequence[int]) -> int:
    """Candidates each beam offers per step: enough that ``width`` beams stay alive even if
    every end-of-sequence token is among them (as transformers' beam search keeps)."""
    return max(2, 1 + len(eos_token_ids)) * width


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator of a seeded request; keep it for the request's lifetime."""
    return torch.Generator(device=device).manual_seed(seed)


def _padded(rows: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Token lists -> ``[len(rows), max_len]`` int64 padded with ``pad``."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out.to(device)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place on ``logits`` ``[len(rows), vocab]`` float32, vLLM/HF definitions:

    repetition (tokens of prompt or output): positive logits / p, negative logits * p;
    frequency: minus f * count in output; presence: minus p if the token is in the output.
    """
    vocab = logits.shape[1]
    dev = logits.device
    out_ids = _padded([r.output_token_ids for r in rows], vocab, dev)
    ones = torch.ones_like(out_ids, dtype=torch.float32)
    counts = torch.zeros(len(rows), vocab + 1, device=dev).scatter_add_(1, out_ids, ones)[:, :vocab]
    in_prompt = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=dev)
    in_prompt.scatter_(1, _padded([r.prompt_token_ids for r in rows], vocab, dev), True)
    seen = in_prompt[:, :vocab] | (counts > 0)
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=dev)[:, None]
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=dev)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=dev)[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits.sub_(freq * counts + pres * (counts > 0))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place: keep each row's ``top_k`` best logits, then the smallest set whose
    probability reaches ``top_p`` (always at least one token); others become -inf.

    logits ``[n, vocab]`` float32; top_k ``[n]`` int64 (vocab = off); top_p ``[n]`` float32.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
    sorted_logits.masked_fill_(rank >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits.masked_fill_((mass_before >= top_p[:, None]) & (rank > 0), float("-inf"))
    logits.scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: -inf where prob < min_p * (max prob of the row); min_p ``[n]`` float32."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    logits.masked_fill_(probs < threshold, float("-inf"))


def has_token_controls(p: SamplingParams) -> bool:
    """Whether a request sets allowed_token_ids, bad_words or logit_bias."""
    return bool(p.allowed_token_ids or p.bad_words_token_ids or p.logit_bias)


def apply_token_controls(logits: torch.Tensor, rows: list[SamplingRow], which: list[int]) -> None:
    """In place on rows ``which`` of ``logits`` ``[len(rows), vocab]`` float32, in vLLM's order:
    every token outside allowed_token_ids becomes -inf; so does the last token of each bad word
    whose other tokens are the last ones the row generated (a one-token word always); then
    logit_bias is added. Each rule is one write at flat indices (row * vocab + token) over all
    the rows (never a per-row pass over the vocabulary); a -inf stays -inf whatever the bias."""
    dev, vocab = logits.device, logits.shape[1]

    def flat(pairs: list[tuple[int, int]]) -> torch.Tensor:
        return torch.tensor([i * vocab + t for i, t in pairs], dtype=torch.int64, device=dev)

    allowed = [i for i in which if rows[i].params.allowed_token_ids]
    if allowed:  # keep the allowed entries (as they are now), fill the rest of the rows with -inf
        at = flat([(i, t) for i in allowed for t in rows[i].params.allowed_token_ids])
        kept = logits.take(at)
        logits.index_fill_(0, torch.tensor(allowed, device=dev), float("-inf"))
        logits.put_(at, kept)
    banned = []
    for i in which:
        out = rows[i].output_token_ids
        for word in rows[i].params.bad_words_token_ids:
            before = len(word) - 1  # tokens that must already end the output
            if before == 0 or (before <= len(out) and list(out[-before:]) == word[:-1]):
                banned.append((i, word[-1]))
    if banned:
        logits.put_(flat(banned), torch.full((len(banned),), float("-inf"), device=dev))
    biased = [i for i in which if rows[i].params.logit_bias]
    if biased:
        at = flat([(i, t) for i in biased for t in rows[i].params.logit_bias])
        values = [b for i in biased for b in rows[i].params.logit_bias.values()]
        logits.put_(at, torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)


def draw_uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The one uniform number [0, 1) a sampled position draws (float64, shape [1]); a seeded
    request's generator advances by exactly this draw per position (spec_decode rewinds it)."""
    return torch.rand(1, dtype=torch.float64, device=device, generator=generator)


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs`` [m, vocab] by inverting its CDF (float64 running sums)
    at a uniform number: exact sampling with one random number per row, where a race of
    exponentials drew one per vocabulary entry (1.6 ms a row of 49k on a CPU core, a fifth of
    a small model's decode step). A token of probability 0 is never picked."""
    cdf = probs.double().cumsum_(dim=-1)
    u = torch.rand(len(generators), dtype=torch.float64, device=probs.device)  # unseeded rows
    for i, g in enumerate(generators):
        if g is not None:
            u[i:i + 1] = draw_uniform(g, probs.device)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return picked.clamp_(max=probs.shape[1] - 1)


class Sampler:
    """Samples one token per row, batched over the rows of a step."""

    def __init__(self, eos_token_ids: Sequence[int] = ()):
        self.eos_token_ids = list(eos_token_ids)  # the min_tokens rule; sizes beam candidate lists

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """logits ``[len(rows), vocab]`` float32 (not modified) -> one token per row.

        A row with fewer than ``min_tokens`` outputs may not pick EOS or a stop token id
        (``min_tokens_ban``). Greedy and beam rows take the exact argmax of the penalised
        logits. Random rows draw one uniform number each (``sample_from_probs``); a row with
        its own generator draws from it alone, so its tokens do not depend on the other rows.
        ``token_bitmask`` (int32 ``[len(rows), token_bitmask_words(vocab)]`` on the logits'
        device, all ones for free rows): only the tokens it allows may be picked (structured
        outputs); the logprobs stay the model's own.
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} rows of logits but {len(rows)} sampling rows")
        for i, r in enumerate(rows):
            if r.params.sampling_type == SamplingType.RANDOM_SEED and r.generator is None:
                raise ValueError(f"row {i} has seed {r.params.seed} but no generator (see make_generator)")
        raw = logits.float()  # the model's own distribution; not modified
        # logprob = logit - log_norm, without a softmax copy; the argmax of the raw rows is the
        # greedy token of every row that no ban or penalty changes.
        want = [needs_logprob(r.params) for r in rows]
        log_norm, token_ids = ops.logsumexp_argmax(raw, None if all(want) else torch.tensor(want),
                                                   bitmask=token_bitmask)
        early = [(i, banned) for i, banned in enumerate(self._banned(r) for r in rows) if banned]
        penalised = [i for i, r in enumerate(rows) if self._has_penalties(r.params)]
        random_types = (SamplingType.RANDOM, SamplingType.RANDOM_SEED)
        random_rows = [i for i, r in enumerate(rows) if r.params.sampling_type in random_types]
        ruled = [i for i, r in enumerate(rows) if has_token_controls(r.params)]
        logits = raw.clone() if early or penalised or random_rows or ruled else raw  # greedy-only steps copy nothing
        for i, banned in early:
            logits[i, banned] = float("-inf")
        if ruled:
            apply_token_controls(logits, rows, ruled)
        if penalised:
            sub = logits[penalised]
            apply_penalties(sub, [rows[i] for i in penalised])
            logits[penalised] = sub
        changed = sorted({i for i, _ in early}.union(penalised, ruled).difference(random_rows))
        if token_bitmask is not None and (changed or random_rows):  # the copy they pick from
            ops.apply_token_bitmask_(logits, token_bitmask)
        if changed:  # greedy and beam rows whose logits a ban, bias or penalty changed
            token_ids[changed] = logits[changed].argmax(dim=-1)
        if random_rows:
            token_ids[random_rows] = self._sample_random(logits[random_rows], [rows[i] for i in random_rows])
        chosen = raw.gather(1, token_ids[:, None])[:, 0] - log_norm
        return SamplerOutput(token_ids, chosen, self._top_logprobs(raw, log_norm, rows))

    def beam_candidates(self, width: int) -> int:
        return beam_candidates(width, self.eos_token_ids)

    def _banned(self, row: SamplingRow) -> list[int]:
        """What ``row`` may not pick now: its own bans and the min_tokens rule's."""
        early = min_tokens_ban(row.params, len(row.output_token_ids), self.eos_token_ids)
        return early + list(row.banned_token_ids) if row.banned_token_ids else early

    @staticmethod
    def _has_penalties(p: SamplingParams) -> bool:
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    @staticmethod
    def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logits ``[m, vocab]`` of random rows -> sampled ids ``[m]`` int64."""
        dev = logits.device
        logits.div_(torch.tensor([r.params.temperature for r in rows], device=dev)[:, None])
        vocab = logits.shape[1]
        top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            apply_top_k_top_p(logits, torch.tensor(top_k, device=dev), torch.tensor(top_p, device=dev))
        if any(r.params.min_p > 0.0 for r in rows):
            apply_min_p(logits, torch.tensor([r.params.min_p for r in rows], device=dev))
        return sample_from_probs(logits.softmax(dim=-1), [r.generator for r in rows])

    def _top_logprobs(self, raw: torch.Tensor, log_norm: torch.Tensor,
                      rows: list[SamplingRow]) -> list[list[tuple[int, float]] | None]:
        """Top (token, logprob) pairs of the rows that asked for them (logprobs or beams)."""
        wanted = [
            max(r.params.logprobs or 0, self.beam_candidates(r.params.best_of) if r.params.use_beam_search else 0)
            for r in rows
        ]
        result: list[list[tuple[int, float]] | None] = [None] * len(rows)
        asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None or r.params.use_beam_search]
        k = min(max((wanted[i] for i in asking), default=0), raw.shape[1])
        if k == 0:
            return result
        values, ids = raw[asking].topk(k, dim=-1)
        values = (values - log_norm[asking, None]).tolist()
        ids = ids.tolist()
        for j, i in enumerate(asking):
            result[i] = list(zip(ids[j][: wanted[i]], values[j][: wanted[i]]))
        return result
