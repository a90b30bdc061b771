"""Paged-attention kernels with vLLM-like names and shapes, for CPU and CUDA tensors.

KV cache layout per layer (``x = 16 // element_size``)::

    key_cache   [num_blocks, num_kv_heads, head_size // x, block_size, x]
    value_cache [num_blocks, num_kv_heads, head_size, block_size]
    slot = block_id * block_size + offset_in_block

Every function checks dtype, device, shape and contiguity (raising ``TypeError`` or
``ValueError``) before any kernel runs, then dispatches on the device: CPU tensors go to
``vpage._ops_cpu``, CUDA tensors to ``vpage._ops_cuda`` (imported on first use).

Inside ``with trusted_arguments():`` the layer ops skip those checks (on this thread): for a
caller that has just validated the same kind of arguments, such as a model whose first layer
of a step ran checked and whose other layers repeat its shapes, dtypes and devices.

One module per concept, every public name re-exported here; callers reach the ops through this
package (``ops.paged_attention(...)``), so patching ``vpage.ops.<name>`` reaches them too:
``_common`` (the argument-check switch, backend dispatch, shared checks), ``threads`` (the CPU
kernels' threads), ``kv_cache`` (cache shapes, writes, block copies), ``attention`` (paged decode
and prefill attention, packed bidirectional attention), ``layer`` (rotary embedding, RMS norms,
gated activations), ``sampler`` (log-normaliser and argmax, token bitmasks), ``matmul`` (GGUF
block and packed dense weights, batched LoRA), ``moe`` (the fused mixture-of-experts block).
"""

from __future__ import annotations

from vpage.ops._common import _checking as _checking
from vpage.ops._common import trusted_arguments
from vpage.ops.attention import packed_attention, paged_attention, paged_prefill_attention
from vpage.ops.kv_cache import copy_blocks, key_cache_shape, reshape_and_cache, swap_blocks, value_cache_shape
from vpage.ops.kv_cache import kv_dtypes_supported as kv_dtypes_supported
from vpage.ops.layer import (fused_add_rms_norm, gelu_tanh_and_mul, rms_norm, rms_norm_heads_, rotary_embedding,
                             sigmoid_gated_add_, silu_and_mul)
from vpage.ops.matmul import DENSE_PANEL_ROWS as DENSE_PANEL_ROWS
from vpage.ops.matmul import LORA_TABLE_WIDTH as LORA_TABLE_WIDTH
from vpage.ops.matmul import (QUANT_TYPES, REPACK_GROUP_ROWS, REPACKED_TYPES, dense_matmul, dense_rows, dequantize_rows,
                              lora_add, pack_dense_weight, quant_matmul, quant_row_bytes, repack_for_cpu, repack_x4,
                              repack_x8)
from vpage.ops.moe import fused_moe, pack_expert_weights
from vpage.ops.sampler import apply_token_bitmask_, logsumexp_argmax, token_bitmask_words
from vpage.ops.threads import get_num_threads, set_num_threads, set_thread_source

# Also here, outside __all__ (re-exported as `name as name`): kv_dtypes_supported (the cache engine),
# DENSE_PANEL_ROWS (packed panels), LORA_TABLE_WIDTH (lora_add's table rows), _checking.

__all__ = [
    "reshape_and_cache", "paged_attention", "paged_prefill_attention", "packed_attention", "copy_blocks",
    "swap_blocks", "rotary_embedding", "key_cache_shape", "value_cache_shape", "set_num_threads",
    "get_num_threads", "set_thread_source", "rms_norm", "fused_add_rms_norm", "rms_norm_heads_",
    "silu_and_mul", "gelu_tanh_and_mul", "sigmoid_gated_add_", "QUANT_TYPES", "REPACKED_TYPES", "REPACK_GROUP_ROWS",
    "quant_row_bytes", "quant_matmul", "dequantize_rows", "repack_x4", "repack_x8", "repack_for_cpu",
    "pack_dense_weight", "dense_matmul", "dense_rows", "lora_add",
    "pack_expert_weights", "fused_moe",
    "logsumexp_argmax",
    "token_bitmask_words", "apply_token_bitmask_", "trusted_arguments",
]
