"""CPU backend of :mod:`vpage.ops` (calls the kernels of ``vpage._core``).

Backend contract, shared with ``vpage._ops_cuda`` (same functions, same signatures):

* ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None``
* ``paged_attention(out, query, key_cache, value_cache, block_tables, context_lens,
  query_start_loc_or_None, scale, max_context_len, sliding_window=0, logits_soft_cap=0.0)
  -> None`` (decode when ``query_start_loc_or_None`` is None, causal prefill otherwise;
  sliding_window and logits_soft_cap 0 = off)
* ``copy_blocks(key_caches, value_caches, block_mapping) -> None``
* ``swap_blocks(src, dst, block_mapping) -> None``
* ``apply_token_bitmask(logits, bitmask) -> None`` (float32 logits with contiguous columns,
  contiguous int32 bitmask)

Every tensor has already been checked by :mod:`vpage.ops` (dtype, device, shape,
contiguity; key/value/query rows may be strided, their inner dims are contiguous) and
``out`` is preallocated. Here all tensors are CPU tensors.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from vpage import _core

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_num_threads: Optional[int] = None
# torch is loaded, so is its OpenMP runtime: run the kernels on its threads (see set_thread_source).
_core.set_thread_source("openmp")


def set_num_threads(num_threads: Optional[int]) -> None:
    """Threads of the CPU kernels; None restores the default (torch.get_num_threads())."""
    global _num_threads
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")
    _num_threads = num_threads


def set_thread_source(source: str) -> str:
    """"openmp" (torch's threads) or "own" (vpage's pool); see vpage.ops.set_thread_source."""
    return _core.set_thread_source(source)


def get_num_threads() -> int:
    """Threads the CPU kernels run on."""
    return _num_threads if _num_threads is not None else torch.get_num_threads()


def _cache_geometry(key_cache: torch.Tensor, value_cache: torch.Tensor) -> dict:
    num_blocks, num_kv_heads, head_size, block_size = value_cache.shape
    return dict(num_blocks=num_blocks, num_kv_heads=num_kv_heads, head_size=head_size,
                block_size=block_size, cache_dtype=DTYPE_CODES[key_cache.dtype])


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _core._cpu_reshape_and_cache(
        key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        slot_mapping.data_ptr(), num_tokens=key.shape[0], key_stride=key.stride(0),
        value_stride=value.stride(0), dtype=DTYPE_CODES[key.dtype], num_threads=get_num_threads(),
        **_cache_geometry(key_cache, value_cache))


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, query_start_loc: Optional[torch.Tensor],
                    scale: float, max_context_len: int, sliding_window: int = 0,
                    logits_soft_cap: float = 0.0, draft_queries: bool = False) -> None:
    _core._cpu_paged_attention(
        out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(),
        0 if query_start_loc is None else query_start_loc.data_ptr(),
        num_seqs=context_lens.shape[0], num_query_tokens=query.shape[0],
        num_heads=query.shape[1], max_blocks_per_seq=block_tables.shape[1],
        max_context_len=max_context_len, query_stride=query.stride(0), scale=scale,
        dtype=DTYPE_CODES[query.dtype], num_threads=get_num_threads(),
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, draft_queries=draft_queries,
        **_cache_geometry(key_cache, value_cache))


def packed_attention(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     seq_info: torch.Tensor, scale: float, window: int) -> None:
    """CPU only; see vpage.ops.packed_attention."""
    num_heads, head_size = query.shape[1], query.shape[2]
    _core._cpu_packed_attention(
        out.data_ptr(), query.data_ptr(), key.data_ptr(), value.data_ptr(), seq_info.data_ptr(),
        num_seqs=seq_info.shape[1], num_query_rows=query.shape[0], num_kv_rows=key.shape[0], num_heads=num_heads,
        head_size=head_size, query_stride=query.stride(0), key_stride=key.stride(0), value_stride=value.stride(0),
        out_stride=out.stride(0), scale=scale, window=window, dtype=DTYPE_CODES[query.dtype],
        num_threads=get_num_threads())


def copy_blocks(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    if not key_caches:
        return
    _core._cpu_copy_blocks(
        [t.data_ptr() for t in key_caches], [t.data_ptr() for t in value_caches],
        block_mapping.data_ptr(), num_pairs=block_mapping.shape[0],
        num_threads=get_num_threads(), **_cache_geometry(key_caches[0], value_caches[0]))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    block_bytes = math.prod(src.shape[1:]) * src.element_size()
    _core._cpu_swap_blocks(
        src.data_ptr(), dst.data_ptr(), block_bytes, block_mapping.data_ptr(),
        num_pairs=block_mapping.shape[0], src_num_blocks=src.shape[0],
        dst_num_blocks=dst.shape[0], num_threads=get_num_threads())


def rotary_embedding(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, num_heads: int,
                     head_size: int, rotary_dim: int = 0) -> None:
    """In place; CPU only (other devices use the torch version in vpage.ops); rotary_dim 0:
    head_size."""
    _core._cpu_rotary_embedding(x.data_ptr(), x.stride(0), positions.data_ptr(), cos_sin.data_ptr(),
                               cos_sin.shape[0], x.shape[0], num_heads, head_size, DTYPE_CODES[x.dtype],
                               get_num_threads(), rotary_dim=rotary_dim)


def rms_norm(out: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
             eps: float) -> None:
    """CPU only; see vpage.ops.rms_norm / fused_add_rms_norm."""
    _core._cpu_rms_norm(out.data_ptr(), x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                       weight.data_ptr(), x.shape[0], x.shape[1], eps, DTYPE_CODES[x.dtype], get_num_threads())


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """CPU only; see vpage.ops.silu_and_mul."""
    _core._cpu_silu_and_mul(out.data_ptr(), x.data_ptr(), x.shape[0], out.shape[1], DTYPE_CODES[x.dtype],
                           get_num_threads())


def gelu_tanh_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """CPU only; see vpage.ops.gelu_tanh_and_mul."""
    _core._cpu_gelu_tanh_and_mul(out.data_ptr(), x.data_ptr(), x.shape[0], out.shape[1], DTYPE_CODES[x.dtype],
                                 get_num_threads())


def sigmoid_gated_add(out: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> None:
    """In place, CPU only; see vpage.ops.sigmoid_gated_add_."""
    _core._cpu_sigmoid_gated_add(out.data_ptr(), y.data_ptr(), gate.data_ptr(), out.shape[0], out.shape[1],
                                 DTYPE_CODES[out.dtype], get_num_threads())


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, num_heads: int, head_size: int) -> None:
    """In place, CPU only; see vpage.ops.rms_norm_heads_."""
    _core._cpu_rms_norm_heads(x.data_ptr(), x.stride(0), weight.data_ptr(), x.shape[0],
                              num_heads, head_size, eps, DTYPE_CODES[x.dtype], get_num_threads())


def quant_matmul(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, type_id: int, n: int, k: int) -> None:
    """CPU only; see vpage.ops.quant_matmul."""
    _core._cpu_quant_matmul(out.data_ptr(), x.data_ptr(), qweight.data_ptr(), x.shape[0], n, k,
                            max(x.stride(0), k), max(out.stride(0), n), type_id, DTYPE_CODES[x.dtype],
                            get_num_threads())


def dense_pack(packed: torch.Tensor, weight: torch.Tensor) -> None:
    """CPU only; see vpage.ops.pack_dense_weight."""
    _core._cpu_dense_pack(packed.data_ptr(), weight.data_ptr(), weight.shape[0], weight.shape[1],
                          max(weight.stride(0), weight.shape[1]), DTYPE_CODES[weight.dtype], get_num_threads())


def dense_matmul(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                 n: int) -> None:
    """CPU only; see vpage.ops.dense_matmul."""
    k = packed.shape[1]
    _core._cpu_dense_matmul(out.data_ptr(), x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                            x.shape[0], n, k, max(x.stride(0), k), max(out.stride(0), n), DTYPE_CODES[x.dtype],
                            DTYPE_CODES[packed.dtype], out.dtype != x.dtype, get_num_threads())


def lora_add(out: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, table: torch.Tensor,
             slice_rows: Sequence[int], weight_dtype: torch.dtype) -> None:
    """CPU only; see vpage.ops.lora_add."""
    k = x.shape[1]
    _core._cpu_lora_add(out.data_ptr(), x.data_ptr(), token_slots.data_ptr(), table.data_ptr(), x.shape[0], k,
                        max(x.stride(0), k), max(out.stride(0), out.shape[1]), table.shape[0], list(slice_rows),
                        DTYPE_CODES[x.dtype], DTYPE_CODES[weight_dtype], get_num_threads())


def _expert_stack(w: torch.Tensor, type_id: Optional[int]) -> tuple:
    """(pointer, bytes between experts, ggml type id or -1, packed dtype code) of an expert stack."""
    return (w.data_ptr(), w.stride(0) * w.element_size(), -1 if type_id is None else type_id,
            DTYPE_CODES.get(w.dtype, 0))


def fused_moe(out: torch.Tensor, x: torch.Tensor, router_logits: Optional[torch.Tensor],
              topk_ids: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], top_k: int, renormalize: bool,
              w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, type_ids: Sequence[Optional[int]],
              intermediate: int) -> None:
    """CPU only; see vpage.ops.fused_moe (expert stacks: packed float panels or uint8 block rows)."""
    hidden = x.shape[1]
    _core._cpu_fused_moe(out.data_ptr(), x.data_ptr(), 0 if router_logits is None else router_logits.data_ptr(),
                         0 if topk_ids is None else topk_ids.data_ptr(),
                         0 if topk_weights is None else topk_weights.data_ptr(), x.shape[0], hidden, intermediate,
                         w1.shape[0], top_k, renormalize, max(x.stride(0), hidden), max(out.stride(0), hidden),
                         DTYPE_CODES[x.dtype], _expert_stack(w1, type_ids[0]), _expert_stack(w3, type_ids[1]),
                         _expert_stack(w2, type_ids[2]), get_num_threads())


def dequantize_rows(out: torch.Tensor, qweight: torch.Tensor, type_id: int, rows: int, k: int) -> None:
    """CPU only; see vpage.ops.dequantize_rows."""
    _core._cpu_quant_dequantize_rows(out.data_ptr(), qweight.data_ptr(), rows, k, type_id)


def repack_x4(out: torch.Tensor, qweight: torch.Tensor, type_id: int, rows: int, k: int) -> bool:
    """CPU only; see vpage.ops.repack_x4."""
    return _core._cpu_quant_repack_x4(out.data_ptr(), qweight.data_ptr(), rows, k, type_id)


def quant_reads_x8() -> bool:
    """Whether the selected instruction set's decode kernel reads x8 rows (see vpage.ops.repack_x8)."""
    return _core.quant_reads_x8()


def repack_x8(out: torch.Tensor, qweight: torch.Tensor, type_id: int, rows: int, k: int) -> None:
    """CPU only; see vpage.ops.repack_x8."""
    _core._cpu_quant_repack_x8(out.data_ptr(), qweight.data_ptr(), rows, k, type_id)


def logsumexp_argmax(logits: torch.Tensor, log_norm: torch.Tensor, argmax: torch.Tensor,
                     want_log_norm: Optional[torch.Tensor], bitmask: Optional[torch.Tensor] = None) -> None:
    """CPU only; see vpage.ops.logsumexp_argmax (``want_log_norm``: contiguous bool or None;
    ``bitmask``: contiguous int32 [rows, >= words] or None)."""
    _core._cpu_logsumexp_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1],
                                max(logits.stride(0), logits.shape[1]), log_norm.data_ptr(), argmax.data_ptr(),
                                0 if want_log_norm is None else want_log_norm.data_ptr(), get_num_threads(),
                                0 if bitmask is None else bitmask.data_ptr(),
                                0 if bitmask is None else bitmask.shape[1])


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place; see vpage.ops.apply_token_bitmask_ (columns contiguous, bitmask contiguous)."""
    _core._cpu_apply_token_bitmask(logits.data_ptr(), logits.shape[0], logits.shape[1],
                                   max(logits.stride(0), logits.shape[1]), bitmask.data_ptr(),
                                   bitmask.shape[1], get_num_threads())
