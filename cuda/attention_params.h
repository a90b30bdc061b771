// Host-side view of the attention kernels: the parameter block and the per-dtype launcher
// (defined in attention_kernel.cuh, instantiated in paged_attention_{f32,f16,bf16}.cu).
#pragma once

#include <cuda_runtime_api.h>

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
  int32_t partition_size = 0;  // tokens per thread block along the context
  int32_t num_partitions = 1;  // gridDim.z
  bool split = false;          // v2: write partials and run the reduce kernel
  float scale = 1.0f;
};

/// Launches the attention kernel(s) for element type T (float, __half, __nv_bfloat16);
/// returns cudaErrorInvalidValue for an unsupported head size or block size.
template <typename T>
cudaError_t launch_paged_attention_typed(const AttentionParams& p, cudaStream_t stream);

}  // namespace vpage::cuda::detail
