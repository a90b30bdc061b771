// Host-side view of the attention kernels: the parameter blocks and the per-dtype launchers
// (defined in attention_kernel.cuh / prefill_attention_kernel.cuh, instantiated in
// paged_attention_{f32,f16,bf16}.cu / prefill_attention_{f32,f16,bf16}.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace vpage::cuda::detail {

inline constexpr int kAttentionThreads = 128;

/// Everything the attention kernels need, resolved on the host (paged_attention.cu).
struct AttentionParams {
  void* out = nullptr;               // [num_rows, num_heads, head_size] T
  float* partial_out = nullptr;      // v2: [num_rows, num_heads, num_partitions, head_size]
  float* partial_max = nullptr;      // v2: [num_rows, num_heads, num_partitions]
  float* partial_sum = nullptr;      // v2: [num_rows, num_heads, num_partitions]
  const void* query = nullptr;       // [num_rows, num_heads, head_size], row stride query_stride
  const void* key_cache = nullptr;   // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  const void* value_cache = nullptr; // [num_blocks, num_kv_heads, head_size, block_size]
  const int32_t* block_tables = nullptr;     // [num_seqs, max_blocks_per_seq]
  const int32_t* context_lens = nullptr;     // [num_seqs]
  const int32_t* query_start_loc = nullptr;  // [num_seqs + 1] or nullptr (decode)
  int64_t num_rows = 0;
  int64_t query_stride = 0;
  int32_t num_seqs = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_size = 0;
  int32_t block_size = 0;
  int32_t max_blocks_per_seq = 0;
  int32_t group_size = 1;      // query heads per KV head (num_heads / num_kv_heads)
  int32_t heads_per_block = 1; // query heads one thread block serves: 1, 2, 4 or 8
  int32_t group_chunks = 1;    // thread blocks per KV head: ceil(group_size / heads_per_block)
  int32_t partition_size = 0;  // tokens per thread block along the context
  int32_t num_partitions = 1;  // gridDim.z
  bool split = false;          // v2: write partials and run the reduce kernel
  float scale = 1.0f;
  int32_t sliding_window = 0;  // > 0: a row at position p sees (p - sliding_window, p]
  float soft_cap = 0.0f;       // > 0: logits become soft_cap * tanh(logit * inv_soft_cap)
  float inv_soft_cap = 0.0f;
};

/// First token a row of `context_len` tokens reads (host and device): the start of the block
/// holding its first windowed key; partitions start there. 0 without a window.
__host__ __device__ inline int window_read_begin(int sliding_window, int block_size, int context_len) {
  if (sliding_window <= 0 || context_len <= sliding_window) return 0;
  return (context_len - sliding_window) / block_size * block_size;
}

/// Geometry of the tiled prefill kernel (prefill_attention_kernel.cuh): kPrefillRows query
/// rows (query tokens x query heads of one GQA group) per thread block, 16 per warp, and
/// KV tiles of prefill_kv_tile(head_size) tokens; host and device share these functions.
inline constexpr int kPrefillWarps = 4;
inline constexpr int kPrefillThreads = kPrefillWarps * 32;
inline constexpr int kPrefillRows = kPrefillWarps * 16;

/// KV tokens per tile: 64, or 32 for head size 256 (bounds registers and shared memory).
constexpr int prefill_kv_tile(int head_size) { return head_size > 128 ? 32 : 64; }

/// Dynamic shared memory of the tiled prefill kernel: Q [rows][hs + pad], K [tile][hs + pad]
/// and V [hs][tile + pad] in the cache dtype; pad = 16 bytes (keeps the fragment loads free
/// of bank conflicts and the 16-byte stores aligned). fp32 (CUDA cores) adds the per-warp
/// probability rows P [rows][tile + 4] float.
constexpr size_t prefill_smem_bytes(int head_size, int elem_size) {
  const int pad = 16 / elem_size;
  const int tile = prefill_kv_tile(head_size);
  const size_t p_rows = elem_size == 4 ? static_cast<size_t>(kPrefillRows) * (tile + 4) * 4 : 0;
  return static_cast<size_t>(elem_size) *
             ((kPrefillRows + tile) * static_cast<size_t>(head_size + pad) + static_cast<size_t>(head_size) * (tile + pad)) +
         p_rows;
}

/// Parameters of the tiled prefill kernel, resolved on the host (paged_attention.cu).
/// A thread block covers query tokens [tile * q_per_tile, + q_per_tile) of one sequence
/// times heads [chunk * heads_per_tile, + heads_per_tile) of the GQA group of one KV head.
struct PrefillParams {
  void* out = nullptr;               // [num_query_tokens, num_heads, head_size] T, contiguous
  const void* query = nullptr;       // [num_query_tokens, num_heads, head_size], row stride query_stride
  const void* key_cache = nullptr;   // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  const void* value_cache = nullptr; // [num_blocks, num_kv_heads, head_size, block_size]
  const int32_t* block_tables = nullptr;     // [num_seqs, max_blocks_per_seq]
  const int32_t* context_lens = nullptr;     // [num_seqs], tokens in cache incl. the queries
  const int32_t* query_start_loc = nullptr;  // [num_seqs + 1]
  int64_t query_stride = 0;
  int32_t num_seqs = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_size = 0;
  int32_t block_shift = 0;     // log2(block_size); block_size in {8, 16, 32}
  int32_t max_blocks_per_seq = 0;
  int32_t group_size = 1;      // num_heads / num_kv_heads
  int32_t heads_per_tile = 1;  // min(group_size, kPrefillRows)
  int32_t head_chunks = 1;     // ceil(group_size / heads_per_tile)
  int32_t q_per_tile = 1;      // kPrefillRows / heads_per_tile
  float scale_log2 = 1.0f;     // softmax scale * log2(e) (the kernel uses exp2)
  int32_t sliding_window = 0;  // > 0: a query at position p sees (p - sliding_window, p]
  float cap_log2 = 0.0f;       // soft cap > 0: scores = cap_log2 * tanh(qk * scale_over_cap)
  float scale_over_cap = 0.0f; // softmax scale / soft cap
};

/// Launches the attention kernel(s) for element type T (float, __half, __nv_bfloat16);
/// returns cudaErrorInvalidValue for an unsupported head size or block size.
template <typename T>
cudaError_t launch_paged_attention_typed(const AttentionParams& p, cudaStream_t stream);

/// Launches the tiled prefill kernel for element type T on a grid of `num_tiles` x
/// (num_kv_heads * head_chunks) thread blocks (instantiated in prefill_attention_{f32,f16,bf16}.cu);
/// cudaErrorInvalidValue for an unsupported head size.
template <typename T>
cudaError_t launch_prefill_attention_typed(const PrefillParams& p, int64_t num_tiles, cudaStream_t stream);

}  // namespace vpage::cuda::detail
