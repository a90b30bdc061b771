// Host side of paged attention: argument checks, the v1/v2/tiled choice, workspace layout
// and dispatch to the per-dtype launchers.
#include "vpage/cuda/attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "attention_params.h"

namespace vpage::cuda {
namespace {

constexpr int kV1MaxContextLen = 8192;
// v1 (whole context per thread block) when its grid has 2 to 4 thread blocks per SM: fewer
// leave SMs idle, more queue up behind v1's large shared memory (H200, batch 256 x 2048
// tokens: v2 0.82 of copy bandwidth against v1's 0.73; batch 64: v1 0.76 against 0.68).
constexpr int kMinBlocksPerSm = 2;
constexpr int kMaxV1BlocksPerSm = 4;
constexpr int kMaxBlockSize = 32;
constexpr size_t kWorkspaceAlign = 256;
// Static shared memory of the attention kernel (up to 8 queries of 256 floats and the
// reduction scratch) stays below this; the rest is for logits.
constexpr size_t kStaticSmemReserve = 12 * 1024;
// v2 partitions shrink from kAttentionPartitionSize down to this (halving) until the grid
// has kMinV2BlocksPerSm thread blocks per SM: small batches still fill the GPU.
constexpr int kMinPartitionSize = 128;
constexpr int kMinV2BlocksPerSm = 4;

size_t align_up(size_t n) { return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

bool supported_shape(const PagedAttentionArgs& a) {
  const int h = a.cache.head_size;
  const int b = a.cache.block_size;
  const bool head_ok = h == 64 || h == 80 || h == 96 || h == 128 || h == 256;
  const bool block_ok = b == 8 || b == 16 || b == 32;
  const bool dtype_ok = a.cache.dtype == DType::kFloat32 || a.cache.dtype == DType::kFloat16 ||
                        a.cache.dtype == DType::kBFloat16;
  return head_ok && block_ok && dtype_ok && a.cache.num_kv_heads > 0 && a.num_heads > 0 &&
         a.num_heads % a.cache.num_kv_heads == 0 && a.max_context_len >= 0 && a.sliding_window >= 0 &&
         a.logits_soft_cap >= 0.0f && std::isfinite(a.logits_soft_cap);
}

int64_t num_rows(const PagedAttentionArgs& a) {
  return a.query_start_loc == nullptr ? a.num_seqs : a.num_query_tokens;
}

/// The most tokens one row reads: max_context_len, or with a sliding window W at most the
/// W keys plus the tokens before them in their first block. Sizes v1's logits, v2's partitions.
int32_t max_read_len(const PagedAttentionArgs& a) {
  const int64_t window_span = int64_t{a.sliding_window} + a.cache.block_size - 1;
  if (a.sliding_window <= 0 || window_span >= a.max_context_len) return a.max_context_len;
  return static_cast<int32_t>(window_span);
}

int num_partitions(int32_t max_context_len, int partition_size) {
  return std::max(1, (max_context_len + partition_size - 1) / partition_size);
}

/// Query heads one decode thread block serves: the GQA group, or a chunk of it (1, 2, 4, 8).
int heads_per_block(int group_size) {
  if (group_size <= 2) return group_size;
  return group_size <= 4 ? 4 : 8;
}

/// Decode thread blocks per row along the heads: num_kv_heads * ceil(group / heads_per_block).
int64_t head_blocks(int32_t num_heads, int32_t num_kv_heads) {
  const int group = num_heads / num_kv_heads;
  const int per_block = heads_per_block(group);
  return int64_t{num_kv_heads} * ((group + per_block - 1) / per_block);
}

bool is_prefill(const PagedAttentionArgs& a) { return a.query_start_loc != nullptr; }

struct DeviceLimits {
  int num_sms = 1;
  size_t max_smem_bytes = 48 * 1024;    // v1 logits: opt-in limit minus kStaticSmemReserve
  size_t optin_smem_bytes = 48 * 1024;  // dynamic shared memory per block (opt-in limit)
  int compute_major = 0;
};

cudaError_t query_device_limits(DeviceLimits* limits) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&limits->num_sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&limits->compute_major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
  int smem = 0;
  err = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  limits->optin_smem_bytes = static_cast<size_t>(smem);
  limits->max_smem_bytes = static_cast<size_t>(smem) - std::min<size_t>(smem, kStaticSmemReserve);
  return err;
}

/// The fields AttentionParams and PrefillParams share, from the public argument struct.
template <typename Params>
void copy_common_params(const PagedAttentionArgs& a, Params* p) {
  p->out = a.out;
  p->query = a.query;
  p->key_cache = a.key_cache;
  p->value_cache = a.value_cache;
  p->block_tables = a.block_tables;
  p->context_lens = a.context_lens;
  p->query_start_loc = a.query_start_loc;
  p->query_stride = a.query_stride;
  p->num_seqs = a.num_seqs;
  p->num_heads = a.num_heads;
  p->num_kv_heads = a.cache.num_kv_heads;
  p->head_size = a.cache.head_size;
  p->max_blocks_per_seq = a.max_blocks_per_seq;
  p->sliding_window = a.sliding_window;
}

/// Whether the tiled prefill kernel can run for `a` on a device with `limits`: 16-bit
/// types need tensor cores of sm_80+, and its tiles must fit the shared memory.
bool tiled_prefill_fits(const PagedAttentionArgs& a, const DeviceLimits& limits) {
  const int elem = dtype_size(a.cache.dtype);
  if (elem == 2 && limits.compute_major < 8) return false;
  return detail::prefill_smem_bytes(a.cache.head_size, elem) <= limits.optin_smem_bytes;
}

/// The tiled prefill kernel: one thread block per (query tile, KV head, head chunk).
cudaError_t launch_tiled_prefill(const PagedAttentionArgs& a, const DeviceLimits& limits, cudaStream_t stream) {
  if (!tiled_prefill_fits(a, limits)) return cudaErrorInvalidValue;
  detail::PrefillParams p;
  copy_common_params(a, &p);
  p.block_shift = a.cache.block_size == 8 ? 3 : a.cache.block_size == 16 ? 4 : 5;
  p.group_size = a.num_heads / a.cache.num_kv_heads;
  p.heads_per_tile = std::min(p.group_size, detail::kPrefillRows);
  p.head_chunks = (p.group_size + p.heads_per_tile - 1) / p.heads_per_tile;
  p.q_per_tile = detail::kPrefillRows / p.heads_per_tile;
  p.scale_log2 = a.scale * 1.4426950408889634f;  // log2(e)
  if (a.logits_soft_cap > 0.0f) {
    p.cap_log2 = a.logits_soft_cap * 1.4426950408889634f;
    p.scale_over_cap = a.scale / a.logits_soft_cap;
  }
  // Sequence s owns virtual tiles from query_start_loc[s] / q_per_tile + s: enough for
  // ceil(query_len / q_per_tile) tiles each (see prefill_attention_kernel.cuh).
  const int64_t num_tiles = a.num_query_tokens / p.q_per_tile + a.num_seqs;
  const int64_t grid_y = int64_t{p.num_kv_heads} * p.head_chunks;
  if (num_tiles > INT_MAX || grid_y > 65535) return cudaErrorInvalidValue;
  if (a.num_seqs == 0) return cudaSuccess;
  switch (a.cache.dtype) {
    case DType::kFloat32: return detail::launch_prefill_attention_typed<float>(p, num_tiles, stream);
    case DType::kFloat16: return detail::launch_prefill_attention_typed<__half>(p, num_tiles, stream);
    case DType::kBFloat16: return detail::launch_prefill_attention_typed<__nv_bfloat16>(p, num_tiles, stream);
  }
  return cudaErrorInvalidValue;
}

size_t v1_smem_bytes(const PagedAttentionArgs& a) {
  const int b = std::max(a.cache.block_size, 1);
  return static_cast<size_t>((std::max(max_read_len(a), 1) + b - 1) / b * b) * sizeof(float);
}

cudaError_t resolve_version(const PagedAttentionArgs& a, AttentionVersion requested, const DeviceLimits& limits,
                            AttentionVersion* out) {
  if (requested == AttentionVersion::kTiled && !is_prefill(a)) return cudaErrorInvalidValue;
  if (requested != AttentionVersion::kAuto) {
    *out = requested;
    return cudaSuccess;
  }
  if (is_prefill(a) && tiled_prefill_fits(a, limits)) {
    *out = AttentionVersion::kTiled;
    return cudaSuccess;
  }
  *out = choose_attention_version(num_rows(a), a.num_heads, a.cache.num_kv_heads, max_read_len(a), limits.num_sms,
                                  limits.max_smem_bytes);
  return cudaSuccess;
}

/// v2's tokens per partition: kAttentionPartitionSize, halved (down to kMinPartitionSize)
/// while the grid would have fewer than kMinV2BlocksPerSm thread blocks per SM.
int v2_partition_size(const PagedAttentionArgs& a, int num_sms) {
  const int64_t blocks = num_rows(a) * head_blocks(a.num_heads, a.cache.num_kv_heads);
  const int32_t read = max_read_len(a);
  int size = kAttentionPartitionSize;
  while (size > kMinPartitionSize && blocks * num_partitions(read, size) < int64_t{kMinV2BlocksPerSm} * num_sms) {
    size /= 2;
  }
  return size;
}

/// v2's partial slots (one per row, head and partition) for partitions of `partition_size`.
size_t v2_slots(const PagedAttentionArgs& a, int partition_size) {
  return static_cast<size_t>(num_rows(a)) * a.num_heads * num_partitions(max_read_len(a), partition_size);
}

/// v2's workspace for partitions of `partition_size`: partial outputs, their maxima and sums.
size_t v2_workspace_bytes(const PagedAttentionArgs& a, int partition_size) {
  const size_t slots = v2_slots(a, partition_size);
  return align_up(slots * a.cache.head_size * sizeof(float)) + 2 * align_up(slots * sizeof(float));
}

cudaError_t launch(const PagedAttentionArgs& a, void* workspace, size_t workspace_bytes,
                   cudaStream_t stream, AttentionVersion requested) {
  if (!supported_shape(a)) return cudaErrorInvalidValue;
  DeviceLimits limits;
  cudaError_t err = query_device_limits(&limits);
  if (err != cudaSuccess) return err;
  AttentionVersion version = AttentionVersion::kV1;
  err = resolve_version(a, requested, limits, &version);
  if (err != cudaSuccess) return err;
  const int64_t rows = num_rows(a);
  if (rows == 0) return cudaSuccess;
  if (version == AttentionVersion::kTiled) return launch_tiled_prefill(a, limits, stream);

  detail::AttentionParams p;
  copy_common_params(a, &p);
  p.num_rows = rows;
  p.block_size = a.cache.block_size;
  p.group_size = a.num_heads / a.cache.num_kv_heads;
  p.heads_per_block = heads_per_block(p.group_size);
  p.group_chunks = (p.group_size + p.heads_per_block - 1) / p.heads_per_block;
  p.scale = a.scale;
  if (a.logits_soft_cap > 0.0f) {
    p.soft_cap = a.logits_soft_cap;
    p.inv_soft_cap = 1.0f / a.logits_soft_cap;
  }
  if (version == AttentionVersion::kV1) {
    const size_t smem = v1_smem_bytes(a);
    if (smem * p.heads_per_block > limits.max_smem_bytes) return cudaErrorInvalidValue;
    p.partition_size = static_cast<int32_t>(smem / sizeof(float));
  } else {
    const int partition_size = v2_partition_size(a, limits.num_sms);
    if (workspace == nullptr || workspace_bytes < v2_workspace_bytes(a, partition_size)) return cudaErrorInvalidValue;
    const size_t slots = v2_slots(a, partition_size);
    char* base = static_cast<char*>(workspace);
    p.partial_out = reinterpret_cast<float*>(base);
    base += align_up(slots * a.cache.head_size * sizeof(float));
    p.partial_max = reinterpret_cast<float*>(base);
    base += align_up(slots * sizeof(float));
    p.partial_sum = reinterpret_cast<float*>(base);
    p.partition_size = partition_size;
    p.num_partitions = num_partitions(max_read_len(a), partition_size);
    p.split = true;
  }
  switch (a.cache.dtype) {
    case DType::kFloat32: return detail::launch_paged_attention_typed<float>(p, stream);
    case DType::kFloat16: return detail::launch_paged_attention_typed<__half>(p, stream);
    case DType::kBFloat16: return detail::launch_paged_attention_typed<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

AttentionVersion choose_attention_version(int64_t num_rows, int32_t num_heads, int32_t num_kv_heads,
                                          int32_t max_context_len, int num_sms, size_t max_smem_bytes) {
  // v1 keeps one logit per token and query head of the thread block, rounded up to a whole
  // block (at most kMaxBlockSize more).
  const int per_block = heads_per_block(num_heads / std::max(num_kv_heads, 1));
  if (static_cast<size_t>(max_context_len + kMaxBlockSize) * sizeof(float) * per_block > max_smem_bytes) {
    return AttentionVersion::kV2;
  }
  if (max_context_len <= kAttentionPartitionSize) return AttentionVersion::kV1;
  const int64_t blocks = num_rows * head_blocks(num_heads, std::max(num_kv_heads, 1));
  const bool v1_grid = blocks >= int64_t{kMinBlocksPerSm} * num_sms && blocks <= int64_t{kMaxV1BlocksPerSm} * num_sms;
  return v1_grid && max_context_len <= kV1MaxContextLen ? AttentionVersion::kV1 : AttentionVersion::kV2;
}

size_t paged_attention_workspace_bytes(const PagedAttentionArgs& args, AttentionVersion version) {
  DeviceLimits limits;
  AttentionVersion resolved = AttentionVersion::kV1;
  if (query_device_limits(&limits) != cudaSuccess || resolve_version(args, version, limits, &resolved) != cudaSuccess) {
    return 0;
  }
  return resolved == AttentionVersion::kV2 ? v2_workspace_bytes(args, v2_partition_size(args, limits.num_sms)) : 0;
}

cudaError_t paged_attention_decode(const PagedAttentionArgs& args, void* workspace, size_t workspace_bytes,
                                   cudaStream_t stream, AttentionVersion version) {
  if (is_prefill(args)) return cudaErrorInvalidValue;
  return launch(args, workspace, workspace_bytes, stream, version);
}

cudaError_t paged_prefill_attention(const PagedAttentionArgs& args, void* workspace, size_t workspace_bytes,
                                    cudaStream_t stream, AttentionVersion version) {
  if (!is_prefill(args)) return cudaErrorInvalidValue;
  return launch(args, workspace, workspace_bytes, stream, version);
}

}  // namespace vpage::cuda
