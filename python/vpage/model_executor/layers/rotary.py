"""Rotary position embedding in Hugging Face's rotate-half convention, for every rope kind of
transformers' ``ROPE_INIT_FUNCTIONS`` that dense decoders use: default, linear, llama3, yarn
(static tables), longrope and dynamic NTK (tables that depend on a sequence's length).

A sequence whose context after a step is L rotates all its tokens of that step with the
frequencies for length L, as transformers' generate with a KV cache does (its prefill at the
prompt's length, then each decode step at its length); keys already cached keep the rotation
they were written with. A chunked prompt therefore rotates each chunk at the context it ends
at, not at the whole prompt's length.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch
from torch import nn

from vpage import ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_ALIASES = {"su": "longrope"}  # Phi-3's first name for longrope


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    """The rope kind of a scaling dict (``rope_type``, or the older ``type``); ValueError
    naming the supported kinds for any other."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type")) or "default"
    kind = _ALIASES.get(kind, kind)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return kind


def rotary_dim_of(head_size: int, scaling: Mapping[str, Any] | None) -> int:
    """Leading dimensions of a head that rotate: ``int(head_size * partial_rotary_factor)``."""
    return int(head_size * float((scaling or {}).get("partial_rotary_factor", 1.0)))


def rope_max_positions(max_position_embeddings: int, scaling: Mapping[str, Any] | None) -> int:
    """The longest context the rope serves: ``max_position_embeddings``, or for dynamic NTK and
    YaRN the trained length stretched by ``factor`` (dynamic: max_position_embeddings x factor;
    yarn: original_max_position_embeddings x factor, when that is longer)."""
    kind = rope_type_of(scaling)
    if kind == "dynamic":
        return int(max_position_embeddings * float(scaling["factor"]))
    if kind == "yarn" and scaling.get("factor") is not None:
        original = int(scaling.get("original_max_position_embeddings") or max_position_embeddings)
        return max(max_position_embeddings, int(original * float(scaling["factor"])))
    return max_position_embeddings


def _exponents(rotary_dim: int) -> torch.Tensor:
    """``2i / rotary_dim`` for i < rotary_dim / 2, float32, as transformers computes them."""
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama-3.1 frequency-dependent scaling of ``inv_freq`` (as Hugging Face defines it)."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rotary_dim: int, theta: float, scaling: Mapping[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: per frequency, a blend of the interpolated (/ factor) and the original inverse
    frequency along a linear ramp between the dimensions that turn beta_fast and beta_slow
    times over the original length; cos and sin scaled by the attention factor."""
    original = int(scaling.get("original_max_position_embeddings") or max_position)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** torch.arange(0, rotary_dim, 2).float().div(rotary_dim)
    extrapolate = 1 - ramp  # weight of the original frequency
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolate) + 1.0 / pos_freqs * extrapolate
    return inv_freq, float(attention)


def _longrope_attention(scaling: Mapping[str, Any], max_position: int) -> float:
    attention = scaling.get("attention_factor")
    if attention is not None:
        return float(attention)
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _dynamic_inv_freq(exponents: torch.Tensor, theta: float, factor: float, max_position: int,
                      seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK inverse frequencies ``[len(seq_lens), rotary_dim / 2]`` for sequences of
    lengths ``seq_lens`` (int64): the base grows with a length past ``max_position``, in
    transformers' float32 operations."""
    dim = 2 * exponents.shape[0]
    seq_lens = seq_lens.clamp(min=max_position)
    base = theta * ((factor * seq_lens / max_position) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / base[:, None] ** exponents[None, :]


def rope_inv_freq(head_size: int, theta: float, scaling: Mapping[str, Any] | None, max_position: int = 2048,
                  seq_len: Optional[int] = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[rotary_dim / 2]`` float32, attention factor) of a rope kind, as
    transformers' ``ROPE_INIT_FUNCTIONS`` give them: ``max_position`` is the config's
    max_position_embeddings, ``seq_len`` the sequence length the kinds that depend on it
    (dynamic, longrope) are evaluated at (None: their short-context value).

    A ``freq_factors`` list in ``scaling`` (GGUF ``rope_freqs``, Llama 3.1+) divides each
    frequency of a default or linear rope. Raises ValueError for unsupported kinds.
    """
    scaling = dict(scaling or {})
    kind = rope_type_of(scaling)
    rotary_dim = rotary_dim_of(head_size, scaling)
    inv_freq = 1.0 / theta ** _exponents(rotary_dim)
    attention = 1.0
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq, attention = _yarn(rotary_dim, theta, scaling, max_position)
    elif kind == "longrope":
        long = seq_len is not None and seq_len > int(scaling["original_max_position_embeddings"])
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"longrope factors of length {factors.shape[0]} for a rotary dimension of {rotary_dim} "
                             f"(expected {rotary_dim // 2})")
        inv_freq = 1.0 / (factors * theta ** _exponents(rotary_dim))
        attention = _longrope_attention(scaling, max_position)
    elif kind == "dynamic":
        lengths = torch.tensor([max_position if seq_len is None else seq_len], dtype=torch.int64)
        inv_freq = _dynamic_inv_freq(_exponents(rotary_dim), theta, float(scaling["factor"]), max_position, lengths)[0]
    if "freq_factors" in scaling:
        if kind not in ("default", "linear"):
            raise ValueError(f"per-frequency rope factors (rope_freqs) apply to default or linear rope, not {kind!r}")
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"{factors.shape[0]} rope frequency factors for {inv_freq.shape[0]} frequencies")
        inv_freq = inv_freq / factors
    return inv_freq, attention


def _table(inv_freq: torch.Tensor, positions: torch.Tensor, attention: float) -> torch.Tensor:
    """cos then sin of ``positions x inv_freq`` (the same float32 products as transformers'
    per-call computation), scaled by ``attention``: ``[len(positions), rotary_dim]``."""
    freqs = positions.float()[:, None] * inv_freq
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return table * attention if attention != 1.0 else table


class RotaryEmbedding(nn.Module):
    """Rotates query and key heads in place, the first ``rotary_dim`` dimensions of each head.

    Static kinds (default, linear, llama3, yarn) hold ``cos_sin``, the table of every position
    (what the C++ layer loop reads); for longrope and dynamic ``cos_sin`` is None and each step
    is planned once, on its first rotation, and reused by every layer of that step.
    """

    def __init__(self, head_size: int, theta: float, scaling: Mapping[str, Any] | None, max_position: int):
        """max_position: the config's max_position_embeddings (the static table covers
        ``rope_max_positions`` of it)."""
        super().__init__()
        scaling = dict(scaling or {})
        self.kind = rope_type_of(scaling)
        self.head_size = head_size
        self.rotary_dim = rotary_dim_of(head_size, scaling)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_size:
            raise ValueError(f"rotary dimension {self.rotary_dim} of a head of {head_size} must be even and positive")
        # Passed only for partial rotary, so a full rotary calls the kernel exactly as before.
        self._kernel_options = {} if self.rotary_dim == head_size else {"rotary_dim": self.rotary_dim}
        if self._kernel_options and "rotary_dim" not in _kernel_parameters():
            raise ValueError(f"partial rotary ({self.rotary_dim} of {head_size} dimensions) needs "
                             "ops.rotary_embedding(rotary_dim=), which this build lacks")
        rows = rope_max_positions(max_position, scaling)
        cos_sin = tables = exponents = None
        if self.kind == "longrope":
            # The short table (positions below the original length) then the long one: a token
            # of a sequence past the original length reads row ``original + position``.
            self.original_max_position = int(scaling["original_max_position_embeddings"])
            short, attention = rope_inv_freq(head_size, theta, scaling, max_position)
            long, _ = rope_inv_freq(head_size, theta, scaling, max_position, self.original_max_position + 1)
            tables = torch.cat((_table(short, torch.arange(self.original_max_position), attention),
                                _table(long, torch.arange(rows), attention)))
        elif self.kind == "dynamic":
            self.original_max_position = max_position
            self.theta, self.factor = float(theta), float(scaling["factor"])
            exponents = _exponents(self.rotary_dim)
        else:
            inv_freq, attention = rope_inv_freq(head_size, theta, scaling, max_position)
            cos_sin = _table(inv_freq, torch.arange(rows), attention)
        self.register_buffer("cos_sin", cos_sin, persistent=False)
        self.register_buffer("_long_short", tables, persistent=False)
        self.register_buffer("_exponents", exponents, persistent=False)
        # The last step planned: (batch, planned while capturing a CUDA graph, positions, table).
        self._step: Optional[tuple[Any, bool, torch.Tensor, torch.Tensor]] = None

    def rotate_(self, qk: torch.Tensor, batch: Any, num_heads: int) -> None:
        """Rotate, in place, the first ``num_heads`` heads of each row of ``qk``
        ``[num_tokens, width]`` (query then key heads of a fused QKV output) for the tokens of
        ``batch`` (a ``ForwardBatch``: their positions, and for rope kinds that depend on a
        sequence's length, its context length)."""
        if self.cos_sin is not None:
            ops.rotary_embedding(qk, batch.positions, self.cos_sin, num_heads, self.head_size, **self._kernel_options)
            return
        positions, table = self._step_tables(batch, qk.is_cuda)
        ops.rotary_embedding(qk, positions, table, num_heads, self.head_size, **self._kernel_options)

    def _step_tables(self, batch: Any, cuda: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, table) the kernel rotates this step's tokens with, computed on the first
        call for ``batch`` (device operations only, no host synchronisation: a CUDA graph
        captures them) and reused while the same batch object comes back. A graph capture
        plans anew, so the captured graph recomputes the plan on every replay."""
        capturing = cuda and torch.cuda.is_current_stream_capturing()
        step = self._step
        if step is not None and step[0] is batch and step[1] == capturing:
            return step[2], step[3]
        n = batch.positions.shape[0]
        if batch.is_decode:
            lengths = batch.context_lens.long()
        elif batch.draft_queries:  # each draft scored as a decode step at its position would be
            lengths = batch.positions + 1
        else:  # each token's sequence's context length
            lengths = batch.context_lens.long().repeat_interleave(batch.query_start_loc.diff(), output_size=n)
        if self.kind == "longrope":
            offset = torch.where(lengths > self.original_max_position, self.original_max_position, 0)
            positions, table = batch.positions + offset, self._long_short
        else:  # dynamic
            inv_freq = _dynamic_inv_freq(self._exponents, self.theta, self.factor, self.original_max_position, lengths)
            freqs = batch.positions.float()[:, None] * inv_freq
            positions = torch.arange(n, device=batch.positions.device)
            table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        # Held (not an id) so a later batch cannot take this one's address and its plan.
        self._step = (batch, capturing, positions, table)
        return positions, table


def _kernel_parameters() -> tuple[str, ...]:
    import inspect

    return tuple(inspect.signature(ops.rotary_embedding).parameters)
