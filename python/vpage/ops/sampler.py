"""The sampler's ops on rows of logits: the fused log-normaliser and argmax, and token bitmasks
(xgrammar's layout) that mask the tokens a grammar disallows."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from vpage import _ops_cpu
from vpage.ops._common import _backend, _check_tensor


def logsumexp_argmax(logits: torch.Tensor, want_log_norm: Optional[torch.Tensor] = None,
                     bitmask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per row of float32 ``logits`` ``[n, vocab]`` (rows may be strided, columns contiguous):
    ``(torch.logsumexp(logits, -1), logits.argmax(-1))`` as float32 ``[n]`` and int64 ``[n]``.

    The argmax is torch's exactly (the first of equal maxima; a NaN counts as the maximum);
    the log-normaliser is within a few 1e-7 relative of a float64 logsumexp. ``want_log_norm``
    (bool ``[n]``, default all): rows it leaves out get only the argmax (their log-normaliser
    is NaN), which on the CPU costs one pass over the row instead of two. A fused kernel on
    the CPU (one pass for the maximum, one for the sum of exponentials); torch elsewhere.
    ``bitmask`` (int32 ``[n, token_bitmask_words(vocab)]``, see apply_token_bitmask_): the
    argmax is over the allowed tokens only, i.e. torch's argmax of the row with its disallowed
    entries set to -inf (a row allowing none gives token 0); the log-normaliser stays that of
    the whole row. On the CPU from the same passes (rows allowing every token cost what they
    cost without a bitmask); elsewhere the argmax of a masked copy."""
    _check_tensor("logits", logits, dtype=torch.float32, ndim=2, contiguous=False)
    n, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits must have at least one column")
    if want_log_norm is not None:
        _check_tensor("want_log_norm", want_log_norm, dtype=torch.bool, ndim=1)
        if want_log_norm.shape[0] != n or want_log_norm.device.type != "cpu":
            raise ValueError(f"want_log_norm must be a CPU bool tensor of {n} rows, got "
                             f"{tuple(want_log_norm.shape)} on {want_log_norm.device}")
    if bitmask is not None:
        _check_bitmask(logits, bitmask)
    if logits.device.type != "cpu" or n == 0 or not _rows_apart(logits):
        log_norm = torch.logsumexp(logits, dim=-1)
        if want_log_norm is not None:
            log_norm.masked_fill_(~want_log_norm.to(log_norm.device), float("nan"))
        if bitmask is None:
            return log_norm, logits.argmax(dim=-1)
        masked = logits.clone(memory_format=torch.contiguous_format)
        apply_token_bitmask_(masked, bitmask)
        return log_norm, masked.argmax(dim=-1)
    log_norm = torch.empty(n, dtype=torch.float32)
    argmax = torch.empty(n, dtype=torch.int64)
    _ops_cpu.logsumexp_argmax(logits, log_norm, argmax,
                              None if want_log_norm is None else want_log_norm.contiguous(), bitmask)
    return log_norm, argmax


def _rows_apart(x: torch.Tensor) -> bool:
    """Contiguous columns and rows at least a row apart (the layout of the row kernels)."""
    n, width = x.shape
    return (width <= 1 or x.stride(1) == 1) and (n <= 1 or x.stride(0) >= width)


def token_bitmask_words(vocab: int) -> int:
    """int32 words of one row of a token bitmask over ``vocab`` tokens (xgrammar's layout:
    bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed)."""
    return (vocab + 31) // 32


def _check_bitmask(logits: torch.Tensor, bitmask: object) -> None:
    _check_tensor("bitmask", bitmask, dtype=torch.int32, ndim=2)
    n, vocab = logits.shape
    words = bitmask.shape[1]
    if bitmask.shape[0] != n or words < token_bitmask_words(vocab) or bitmask.device != logits.device:
        raise ValueError(f"bitmask must be int32 [{n}, >= {token_bitmask_words(vocab)}] on {logits.device}, got "
                         f"{tuple(bitmask.shape)} on {bitmask.device}")


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: ``-inf`` in float32 ``logits`` ``[n, vocab]`` (rows may be strided, columns
    contiguous) wherever the contiguous int32 ``bitmask`` ``[n, >= token_bitmask_words(vocab)]``
    has a 0 bit (bits past ``vocab`` are ignored; rows of all ones are unchanged). A kernel on
    the CPU (vectorised, threads over rows and over the vocabulary) and on CUDA."""
    _check_tensor("logits", logits, dtype=torch.float32, ndim=2, contiguous=False)
    _check_bitmask(logits, bitmask)
    if not _rows_apart(logits):
        raise ValueError(f"logits must have contiguous columns and rows at least a row apart (strides "
                         f"{logits.stride()})")
    if logits.numel() == 0:
        return
    _backend(logits.device).apply_token_bitmask(logits, bitmask)
