"""CUDA backend of :mod:`vpage.ops`: thin calls into ``vpage._cuda`` for CUDA tensors.

``vpage.ops`` validates dtype, device, shape and contiguity before calling these functions;
here tensors become raw device pointers, sizes and strides. Every launch runs on the
tensors' device (a ``torch.cuda.device`` guard around the call) and on that device's
current stream (``torch.cuda.current_stream(device)``), so tensors on ``cuda:1`` work
whatever the current device is.

Overlapping swaps with compute: run :func:`swap_blocks` under
``with torch.cuda.stream(swap_stream):`` (host pools pinned), record a ``torch.cuda.Event``
on ``swap_stream`` afterwards, and ``torch.cuda.current_stream().wait_event(event)`` before
the first kernel that reads the swapped-in blocks.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

try:
    from . import _cuda
except ImportError:  # built without CUDA
    _cuda = None

HAS_KERNELS = _cuda is not None  # vpage was built with CUDA (whether or not a GPU is present)

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_VERSIONS = {"auto": 0, "v1": 1, "v2": 2, "tiled": 3}
_attention_version = "auto"


def is_available() -> bool:
    """True when vpage was built with CUDA and a CUDA device is present."""
    return _cuda is not None and _cuda.is_available()


def set_attention_version(version: str) -> str:
    """Selects the attention kernel: "auto" (decode: v1/v2 heuristic; prefill: the tiled
    kernel where the GPU can run it, else the per-row kernels), "v1" (one pass) or "v2" (split
    context + reduce) per query row, or "tiled" (prefill only: one thread block per query
    tile and KV head group; decode raises). Returns the previous setting. For tests and
    benchmarks."""
    global _attention_version
    if version not in _VERSIONS:
        raise ValueError(f"attention version must be one of {sorted(_VERSIONS)}, got {version!r}")
    previous, _attention_version = _attention_version, version
    return previous


@contextlib.contextmanager
def attention_version(version: str) -> Iterator[None]:
    """Context manager form of :func:`set_attention_version`."""
    previous = set_attention_version(version)
    try:
        yield
    finally:
        set_attention_version(previous)


def _stream(device: torch.device) -> int:
    """Handle of the current stream of ``device`` (not of the current device)."""
    return torch.cuda.current_stream(device).cuda_stream


def _rows(t: torch.Tensor) -> int:
    """Row stride of a 2-D tensor with contiguous columns (a single row may report any)."""
    return max(t.stride(0), t.shape[1])


def _cache_geometry(key_cache: torch.Tensor) -> dict:
    # key_cache [num_blocks, num_kv_heads, head_size / x, block_size, x]
    num_blocks, num_kv_heads, packs, block_size, x = key_cache.shape
    return dict(num_blocks=num_blocks, num_kv_heads=num_kv_heads, head_size=packs * x,
                block_size=block_size, dtype=_DTYPE_CODES[key_cache.dtype])


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes key/value [num_tokens, num_kv_heads, head_size] (rows may be strided) into
    their slots (int64 slot_mapping [num_tokens], slot < 0 skips)."""
    device = key_cache.device
    with torch.cuda.device(device):
        _cuda.reshape_and_cache(
            key=key.data_ptr(), value=value.data_ptr(), key_cache=key_cache.data_ptr(),
            value_cache=value_cache.data_ptr(), slot_mapping=slot_mapping.data_ptr(),
            num_tokens=key.shape[0], key_stride=key.stride(0), value_stride=value.stride(0),
            stream=_stream(device), **_cache_geometry(key_cache))


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, query_start_loc: Optional[torch.Tensor],
                    scale: float, max_context_len: Optional[int], sliding_window: int = 0,
                    logits_soft_cap: float = 0.0) -> torch.Tensor:
    """Paged attention into ``out`` [num_query_tokens, num_heads, head_size]. Decode when
    ``query_start_loc`` is None (one query row per sequence), else causal prefill with the
    rows of sequence s in [query_start_loc[s], query_start_loc[s + 1]). int32 tables.
    sliding_window / logits_soft_cap: 0 = off (see vpage.ops.paged_attention)."""
    if max_context_len is None:
        max_context_len = int(context_lens.max().item()) if context_lens.numel() else 0
    geometry = _cache_geometry(key_cache)
    num_seqs = block_tables.shape[0]
    num_query_tokens = query.shape[0]
    num_heads = query.shape[1]
    version = _VERSIONS[_attention_version]
    prefill = query_start_loc is not None
    device = query.device
    with torch.cuda.device(device):  # the workspace size depends on the device too
        workspace_bytes = _cuda.paged_attention_workspace_bytes(
            num_seqs=num_seqs, num_query_tokens=num_query_tokens, num_heads=num_heads,
            max_context_len=max_context_len, prefill=prefill, version=version,
            sliding_window=sliding_window, **geometry)
        workspace = None
        if workspace_bytes:
            workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        _cuda.paged_attention(
            out=out.data_ptr(), query=query.data_ptr(), key_cache=key_cache.data_ptr(),
            value_cache=value_cache.data_ptr(), block_tables=block_tables.data_ptr(),
            context_lens=context_lens.data_ptr(),
            query_start_loc=query_start_loc.data_ptr() if prefill else 0,
            num_seqs=num_seqs, num_query_tokens=num_query_tokens, num_heads=num_heads,
            query_stride=query.stride(0), max_blocks_per_seq=block_tables.shape[1],
            max_context_len=max_context_len, scale=float(scale),
            workspace=workspace.data_ptr() if workspace is not None else 0,
            workspace_bytes=workspace_bytes, version=version, stream=_stream(device),
            sliding_window=sliding_window, logits_soft_cap=float(logits_soft_cap), **geometry)
    return out


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copies blocks src -> dst (int64 block_mapping [num_pairs, 2], any device) in every
    layer's key and value cache, in one launch."""
    if not key_caches or block_mapping.numel() == 0:
        return
    device = key_caches[0].device
    mapping = block_mapping.to(device=device, dtype=torch.int64).contiguous()
    key_ptrs = torch.tensor([t.data_ptr() for t in key_caches], dtype=torch.int64).to(device)
    value_ptrs = torch.tensor([t.data_ptr() for t in value_caches], dtype=torch.int64).to(device)
    with torch.cuda.device(device):
        _cuda.copy_blocks(
            key_caches=key_ptrs.data_ptr(), value_caches=value_ptrs.data_ptr(),
            num_layers=len(key_caches), block_mapping=mapping.data_ptr(),
            num_pairs=mapping.shape[0], stream=_stream(device), **_cache_geometry(key_caches[0]))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies whole blocks src[i] -> dst[j] for (i, j) in block_mapping (int64 [num_pairs, 2],
    on the CPU) between a CUDA cache and a (pinned) CPU cache of the same block layout,
    asynchronously on the current stream of the CUDA side's device."""
    mapping = block_mapping.to(dtype=torch.int64).contiguous()
    if mapping.numel() == 0:
        return
    if mapping.device.type != "cpu":
        mapping = mapping.cpu()
    device = src.device if src.device.type == "cuda" else dst.device
    with torch.cuda.device(device):
        _cuda.swap_blocks(
            src=src.data_ptr(), dst=dst.data_ptr(), block_bytes=src.stride(0) * src.element_size(),
            block_mapping=mapping.data_ptr(), num_pairs=mapping.shape[0], stream=_stream(device))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf in float32 logits [n, vocab] (rows may be strided, columns contiguous)
    wherever the contiguous int32 bitmask [n, >= ceil(vocab / 32)] has a 0 bit."""
    device = logits.device
    with torch.cuda.device(device):
        _cuda.apply_token_bitmask(
            logits=logits.data_ptr(), num_rows=logits.shape[0], vocab=logits.shape[1],
            row_stride=_rows(logits), bitmask=bitmask.data_ptr(),
            bitmask_stride=bitmask.shape[1], stream=_stream(device))


def fused_moe(out: torch.Tensor, x: torch.Tensor, router_logits: Optional[torch.Tensor],
              topk_ids: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], top_k: int, renormalize: bool,
              w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, intermediate: int) -> None:
    """out [m, hidden] = the MoE block on x (see vpage.ops.fused_moe); w1, w3 [E, intermediate,
    hidden] and w2 [E, hidden, intermediate] plain expert stacks of x's dtype (each expert
    contiguous). The workspace is a fresh device tensor from torch's caching allocator."""
    device = x.device
    m, hidden = x.shape
    with torch.cuda.device(device):
        size = _cuda.fused_moe_workspace_bytes(m, top_k, w1.shape[0], hidden, intermediate)
        workspace = torch.empty(size, dtype=torch.uint8, device=device)
        _cuda.fused_moe(
            out=out.data_ptr(), x=x.data_ptr(), router_logits=0 if router_logits is None else router_logits.data_ptr(),
            topk_ids=0 if topk_ids is None else topk_ids.data_ptr(),
            topk_weights=0 if topk_weights is None else topk_weights.data_ptr(), m=m, hidden=hidden,
            intermediate=intermediate, num_experts=w1.shape[0], top_k=top_k, renormalize=renormalize,
            x_stride=_rows(x), out_stride=_rows(out), dtype=_DTYPE_CODES[x.dtype],
            w1=(w1.data_ptr(), w1.stride(0) * w1.element_size()), w3=(w3.data_ptr(), w3.stride(0) * w3.element_size()),
            w2=(w2.data_ptr(), w2.stride(0) * w2.element_size()), workspace=workspace.data_ptr(),
            workspace_bytes=size, stream=_stream(device))


def rms_norm(out: torch.Tensor, input: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
             epsilon: float) -> None:
    """out [rows, cols] = rms_norm(input) * weight; with ``residual`` (then out is input):
    residual += input first, and input gets the norm of the new residual."""
    device = input.device
    with torch.cuda.device(device):
        _cuda.rms_norm(out=out.data_ptr(), out_stride=_rows(out), input=input.data_ptr(), input_stride=_rows(input),
                       residual=0 if residual is None else residual.data_ptr(), weight=weight.data_ptr(),
                       rows=input.shape[0], cols=input.shape[1], epsilon=epsilon, dtype=_DTYPE_CODES[input.dtype],
                       stream=_stream(device))


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, epsilon: float, num_heads: int, head_size: int) -> None:
    """In place, the first num_heads heads of every row of x [tokens, width] (strided rows)."""
    device = x.device
    with torch.cuda.device(device):
        _cuda.rms_norm_heads(x=x.data_ptr(), tokens=x.shape[0], row_stride=_rows(x), num_heads=num_heads,
                             head_size=head_size, weight=weight.data_ptr(), epsilon=epsilon,
                             dtype=_DTYPE_CODES[x.dtype], stream=_stream(device))


def rotary_embedding(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int, head_size: int,
                     rotary_dim: int) -> None:
    """In place, rotate-half over the first rotary_dim values of the first num_heads heads."""
    device = x.device
    with torch.cuda.device(device):
        _cuda.rotary_embedding(x=x.data_ptr(), tokens=x.shape[0], row_stride=_rows(x), positions=positions.data_ptr(),
                               cos_sin=cos_sin.data_ptr(), num_heads=num_heads, head_size=head_size,
                               rotary_dim=rotary_dim, dtype=_DTYPE_CODES[x.dtype], stream=_stream(device))


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """out [tokens, d] = silu(input[:, :d]) * input[:, d:]."""
    device = input.device
    with torch.cuda.device(device):
        _cuda.silu_and_mul(out=out.data_ptr(), out_stride=_rows(out), input=input.data_ptr(),
                           input_stride=_rows(input), tokens=input.shape[0], d=out.shape[1],
                           dtype=_DTYPE_CODES[input.dtype], stream=_stream(device))


def lora_add(out: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, table: torch.Tensor,
             slice_rows: Sequence[int], max_rank: int, weight_dtype: Optional[torch.dtype] = None) -> None:
    """In place, for every row t whose slot ``s = token_slots[t]`` (int32 ``[m]``, -1: none) has an
    A: ``out[t, slice j] += (x[t] @ A_s[j rank : (j + 1) rank].T) @ B_{s,j}.T`` for each slice j
    whose B is set, float32 in between, out rounded once. out ``[m, sum(slice_rows)]`` and x ``[m,
    k]`` of one dtype (strided rows, contiguous columns); table contiguous int64 ``[num_slots,
    5]`` on the device, a row ``(A, B0, B1, B2, rank)``: data pointers (0: none) of contiguous
    row-major weights of ``weight_dtype`` (default x's), A ``[len(slice_rows) * rank, k]``, B
    ``[slice_rows[j], rank]``; every rank at most ``max_rank``. Rows of slots out of range are
    skipped (no host check: no synchronisation). The float32 workspace comes from torch's
    caching allocator."""
    device = x.device
    m, k = x.shape
    rows = [int(r) for r in slice_rows]
    if m == 0 or max_rank <= 0 or table.shape[0] == 0:
        return
    with torch.cuda.device(device):
        workspace = torch.empty(m * len(rows) * max_rank, dtype=torch.float32, device=device)
        _cuda.lora_add(
            out=out.data_ptr(), x=x.data_ptr(), token_slots=token_slots.data_ptr(), table=table.data_ptr(), m=m, k=k,
            x_stride=_rows(x), out_stride=_rows(out), num_slots=table.shape[0], slice_rows=rows, max_rank=max_rank,
            dtype=_DTYPE_CODES[x.dtype], weight_dtype=_DTYPE_CODES[weight_dtype or x.dtype],
            workspace=workspace.data_ptr(), workspace_bytes=workspace.numel() * 4, stream=_stream(device))
