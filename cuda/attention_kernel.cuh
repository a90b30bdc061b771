// The paged attention kernels, templated on dtype, head size, block size and the query
// heads per thread block. Included by paged_attention_{f32,f16,bf16}.cu, each of which
// instantiates one dtype.
//
// Grid and threads: blockIdx.x = (row * num_kv_heads + kv_head) * group_chunks + chunk, where
// a row is a sequence (decode) or a query token (prefill) and the kGroup query heads
// [chunk * kGroup, + kGroup) of the KV head's GQA group (group_size heads) share the thread
// block, so each K/V element is read once for all of them (slots past the group's end
// compute on zero queries and write nothing); blockIdx.z = partition of the context.
// 128 threads = 4 warps per thread block.
//
// paged_attention_kernel, per (row, head group, partition) of up to partition_size tokens:
//  1. The kGroup queries (times scale) -> shared memory as float.
//  2. Logits: warp w walks the KV blocks w, w + 4, ... of the partition. In one step a warp
//     covers a whole KV block: lane -> token lane % block_size and 16-byte key fragments
//     lane / block_size, + 32 / block_size, ...; one load instruction of the warp reads 512
//     contiguous bytes, and each fragment meets all kGroup queries (float4 reads of shared
//     memory). Partial dot products meet by shuffles; logits -> shared memory [kGroup][partition].
//  3. Softmax in fp32 over the partition, per head (block-wide max and sum of kGroup values).
//  4. Values: warp w owns head-dim rows [w * H / 4, (w + 1) * H / 4) and walks every KV block
//     of the partition, kValueBatch blocks per step (their loads issued before any use);
//     lane -> 16-byte token chunk lane % c of rows lane / c + k * (32 / c), c = block_size / x.
//     The c lanes of a row meet by shuffles; no cross-warp reduction is needed.
//  v1 (one partition) normalises and writes `out`; v2 writes the unnormalised partial
//  output, its max logit and exp sum to the workspace for paged_attention_reduce_kernel.
// Tokens past the context are never loaded: their keys are skipped, chunks of values past
// the end are skipped, and the one chunk that crosses the end is read element by element
// (its probabilities past the end are zero, as are the values: the cache may hold NaNs there).
// With a sliding window the partitions start at the block holding the row's first windowed
// key (window_read_begin), so blocks wholly before the window are never read; the tokens of
// that block before the window get logit -inf. The soft cap, when set, maps each logit
// through soft_cap * tanh(logit / soft_cap) before the mask.
//
// paged_attention_reduce_kernel, per (row, head): 128 threads combine the partitions
// (rescaled by exp(max_p - max)) and write `out`; threads map onto head-dim elements.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_params.h"
#include "dtype_utils.cuh"

namespace vpage::cuda::detail {

/// The sequence of a row and how many context tokens that row attends to.
struct AttentionRow {
  int32_t seq;
  int32_t context_len;
};

__device__ __forceinline__ AttentionRow resolve_row(const AttentionParams& p, int64_t row) {
  if (p.query_start_loc == nullptr) {
    return {static_cast<int32_t>(row), p.context_lens[row]};
  }
  // Largest seq with query_start_loc[seq] <= row (skips sequences without query tokens).
  int lo = 0;
  int hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.query_start_loc[mid] <= row) lo = mid; else hi = mid - 1;
  }
  const int32_t first = p.query_start_loc[lo];
  const int32_t num_queries = p.query_start_loc[lo + 1] - first;
  const int32_t pos = p.context_lens[lo] - num_queries + static_cast<int32_t>(row - first);
  return {lo, pos + 1};
}

/// Max (kMax) or sum over the thread block of each of kGroup values; `scratch` holds
/// [kNumWarps][kGroup] floats. Every thread gets the results in `v`.
template <int kNumWarps, int kGroup, bool kMax>
__device__ __forceinline__ void block_reduce_group(float (&v)[kGroup], float (*scratch)[kGroup]) {
#pragma unroll
  for (int j = 0; j < kGroup; ++j) v[j] = kMax ? warp_max(v[j]) : warp_sum(v[j]);
  if (threadIdx.x % kWarpSize == 0) {
#pragma unroll
    for (int j = 0; j < kGroup; ++j) scratch[threadIdx.x / kWarpSize][j] = v[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kGroup; ++j) {
    float r = scratch[0][j];
#pragma unroll
    for (int w = 1; w < kNumWarps; ++w) r = kMax ? fmaxf(r, scratch[w][j]) : r + scratch[w][j];
    v[j] = r;
  }
  __syncthreads();
}

template <typename T, int kHeadSize, int kBlockSize, int kGroup>
__global__ void __launch_bounds__(kAttentionThreads) paged_attention_kernel(const AttentionParams p) {
  constexpr int kX = kPack<T>;
  constexpr int kNumWarps = kAttentionThreads / kWarpSize;
  constexpr int kKeyFrags = kHeadSize / kX;
  constexpr int kLanesPerToken = kWarpSize / kBlockSize;
  constexpr int kFragsPerLane = (kKeyFrags + kLanesPerToken - 1) / kLanesPerToken;
  constexpr int kValueChunks = kBlockSize / kX;            // 16-byte chunks per head-dim row of a block
  constexpr int kRowsPerPass = kWarpSize / kValueChunks;   // rows one load instruction of a warp covers
  constexpr int kWarpRows = kHeadSize / kNumWarps;         // head-dim rows a warp owns
  constexpr int kRowsPerLane = (kWarpRows + kRowsPerPass - 1) / kRowsPerPass;
  constexpr int kValueBatch = kRowsPerLane >= 4 ? 2 : 4;   // blocks whose value loads are in flight together
  constexpr int64_t kHeadElems = int64_t{kHeadSize} * kBlockSize;
  static_assert(kHeadSize % kX == 0 && kBlockSize % kX == 0 && kWarpSize % kBlockSize == 0);
  static_assert(kHeadSize % kNumWarps == 0 && kX % 4 == 0);

  __shared__ __align__(16) float q_smem[kGroup][kHeadSize];
  __shared__ float red_smem[kNumWarps][kGroup];
  extern __shared__ __align__(16) float logits[];  // [kGroup][partition_size]

  const int64_t row = blockIdx.x / (int64_t{p.num_kv_heads} * p.group_chunks);
  const int head_block = static_cast<int>(blockIdx.x % (int64_t{p.num_kv_heads} * p.group_chunks));
  const int kv_head = head_block / p.group_chunks;
  const int first_head = kv_head * p.group_size + (head_block % p.group_chunks) * kGroup;
  const int num_group_heads = min(kGroup, (kv_head + 1) * p.group_size - first_head);
  const int partition = static_cast<int>(blockIdx.z);
  const int64_t out_index = row * p.num_heads + first_head;  // of head slot 0
  const AttentionRow r = resolve_row(p, row);
  const int window_begin = p.sliding_window > 0 ? max(0, r.context_len - p.sliding_window) : 0;
  const int start = window_read_begin(p.sliding_window, kBlockSize, r.context_len) + partition * p.partition_size;
  if (start >= r.context_len) {
    if (!p.split && r.context_len <= 0) {
      T* out = static_cast<T*>(p.out) + out_index * kHeadSize;
      for (int i = threadIdx.x; i < num_group_heads * kHeadSize; i += kAttentionThreads) out[i] = from_float<T>(0.0f);
    }
    return;
  }
  const int end = min(start + p.partition_size, r.context_len);
  const int first_block = start / kBlockSize;
  const int end_block = (end + kBlockSize - 1) / kBlockSize;
  const int32_t* block_table = p.block_tables + int64_t{r.seq} * p.max_blocks_per_seq;
  const int64_t block_stride = p.num_kv_heads * kHeadElems;
  const T* key_cache = static_cast<const T*>(p.key_cache) + kv_head * kHeadElems;
  const T* value_cache = static_cast<const T*>(p.value_cache) + kv_head * kHeadElems;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;

  const T* query = static_cast<const T*>(p.query) + row * p.query_stride + int64_t{first_head} * kHeadSize;
  for (int i = threadIdx.x; i < kGroup * kHeadSize; i += kAttentionThreads) {
    const int j = i / kHeadSize;
    q_smem[j][i % kHeadSize] = j < num_group_heads ? to_float(query[i]) * p.scale : 0.0f;
  }
  __syncthreads();

  const int token_in_block = lane % kBlockSize;
  const int frag_group = lane / kBlockSize;
  float max_logit[kGroup];
#pragma unroll
  for (int j = 0; j < kGroup; ++j) max_logit[j] = -INFINITY;
  for (int b = first_block + warp; b < end_block; b += kNumWarps) {
    const int token = b * kBlockSize + token_in_block;
    float qk[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) qk[j] = 0.0f;
    if (token < end) {
      const T* key = key_cache + block_table[b] * block_stride + token_in_block * kX;
#pragma unroll 8  // bounds live key fragments (head 256 fp32 has 32 per lane)
      for (int i = 0; i < kFragsPerLane; ++i) {
        const int f = frag_group + i * kLanesPerToken;
        if (kKeyFrags % kLanesPerToken == 0 || f < kKeyFrags) {
          float k[kX];
          load_pack(key + f * (kBlockSize * kX), k);
#pragma unroll
          for (int j = 0; j < kGroup; ++j) {
            const float4* q4 = reinterpret_cast<const float4*>(&q_smem[j][f * kX]);
#pragma unroll
            for (int c = 0; c < kX / 4; ++c) {
              const float4 q = q4[c];
              qk[j] = fmaf(q.x, k[4 * c], qk[j]);
              qk[j] = fmaf(q.y, k[4 * c + 1], qk[j]);
              qk[j] = fmaf(q.z, k[4 * c + 2], qk[j]);
              qk[j] = fmaf(q.w, k[4 * c + 3], qk[j]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
#pragma unroll
      for (int mask = kBlockSize; mask < kWarpSize; mask <<= 1) qk[j] += __shfl_xor_sync(kFullMask, qk[j], mask);
    }
    if (token < end) {
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        float logit = qk[j];
        if (p.soft_cap > 0.0f) logit = p.soft_cap * tanhf(logit * p.inv_soft_cap);
        if (token < window_begin) logit = -INFINITY;  // only in the window's first block
        if (frag_group == 0) logits[j * p.partition_size + token - start] = logit;
        max_logit[j] = fmaxf(max_logit[j], logit);
      }
    }
  }
  block_reduce_group<kNumWarps, kGroup, true>(max_logit, red_smem);  // max_logit: the maxima now

  const int num_tokens = end - start;
  float exp_sum[kGroup];
#pragma unroll
  for (int j = 0; j < kGroup; ++j) exp_sum[j] = 0.0f;
  for (int i = threadIdx.x; i < num_tokens; i += kAttentionThreads) {
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const float e = expf(logits[j * p.partition_size + i] - max_logit[j]);
      logits[j * p.partition_size + i] = e;
      exp_sum[j] += e;
    }
  }
  block_reduce_group<kNumWarps, kGroup, false>(exp_sum, red_smem);  // also orders the logits writes

  const int lane_chunk = lane % kValueChunks;
  const int row_in_pass = lane / kValueChunks;
  const int warp_row0 = warp * kWarpRows;
  float acc[kRowsPerLane][kGroup];
#pragma unroll
  for (int i = 0; i < kRowsPerLane; ++i) {
#pragma unroll
    for (int j = 0; j < kGroup; ++j) acc[i][j] = 0.0f;
  }
  for (int b0 = first_block; b0 < end_block; b0 += kValueBatch) {
    uint4 raw[kValueBatch][kRowsPerLane];
#pragma unroll
    for (int u = 0; u < kValueBatch; ++u) {
      const int token0 = (b0 + u) * kBlockSize + lane_chunk * kX;
      if (b0 + u < end_block && token0 + kX <= end) {
        const T* value = value_cache + block_table[b0 + u] * block_stride + lane_chunk * kX;
#pragma unroll
        for (int i = 0; i < kRowsPerLane; ++i) {
          const int r_in_warp = row_in_pass + i * kRowsPerPass;
          if (kWarpRows % kRowsPerPass == 0 || r_in_warp < kWarpRows) {
            raw[u][i] = *reinterpret_cast<const uint4*>(value + (warp_row0 + r_in_warp) * kBlockSize);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kValueBatch; ++u) {
      const int token0 = (b0 + u) * kBlockSize + lane_chunk * kX;
      if (b0 + u >= end_block || token0 >= end) continue;
      const bool whole = token0 + kX <= end;
      const T* value = value_cache + block_table[b0 + u] * block_stride + lane_chunk * kX;
      float v[kRowsPerLane][kX];
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) {
        const int r_in_warp = row_in_pass + i * kRowsPerPass;
        if (kWarpRows % kRowsPerPass != 0 && r_in_warp >= kWarpRows) {
#pragma unroll
          for (int t = 0; t < kX; ++t) v[i][t] = 0.0f;
        } else if (whole) {
          widen<T>(raw[u][i], v[i]);
        } else {  // the chunk crossing the context end: element loads of the valid tokens only
          const T* elems = value + (warp_row0 + r_in_warp) * kBlockSize;
#pragma unroll
          for (int t = 0; t < kX; ++t) v[i][t] = token0 + t < end ? to_float(elems[t]) : 0.0f;
        }
      }
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        // Probabilities of this chunk's tokens for head slot j; past the end they are zero
        // (the logits there were never written).
        float prob[kX];
        const float4* l4 = reinterpret_cast<const float4*>(&logits[j * p.partition_size + token0 - start]);
#pragma unroll
        for (int c = 0; c < kX / 4; ++c) {
          const float4 l = l4[c];
          prob[4 * c] = l.x;
          prob[4 * c + 1] = l.y;
          prob[4 * c + 2] = l.z;
          prob[4 * c + 3] = l.w;
        }
        if (!whole) {
#pragma unroll
          for (int t = 0; t < kX; ++t) prob[t] = token0 + t < end ? prob[t] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < kRowsPerLane; ++i) {
#pragma unroll
          for (int t = 0; t < kX; ++t) acc[i][j] = fmaf(prob[t], v[i][t], acc[i][j]);
        }
      }
    }
  }

  const int64_t partial_index = out_index * p.num_partitions + partition;  // head slot 0's
#pragma unroll
  for (int i = 0; i < kRowsPerLane; ++i) {
    const int r_in_warp = row_in_pass + i * kRowsPerPass;
    const int d = warp_row0 + r_in_warp;
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
#pragma unroll
      for (int mask = 1; mask < kValueChunks; mask <<= 1) acc[i][j] += __shfl_xor_sync(kFullMask, acc[i][j], mask);
      if (lane_chunk != 0 || j >= num_group_heads || !(kWarpRows % kRowsPerPass == 0 || r_in_warp < kWarpRows)) {
        continue;
      }
      if (p.split) {
        p.partial_out[(partial_index + int64_t{j} * p.num_partitions) * kHeadSize + d] = acc[i][j];
      } else {
        // exp_sum is in [1, partition_size]
        static_cast<T*>(p.out)[(out_index + j) * kHeadSize + d] = from_float<T>(acc[i][j] * __fdividef(1.0f, exp_sum[j]));
      }
    }
  }
  if (p.split && threadIdx.x < num_group_heads) {
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      if (j == static_cast<int>(threadIdx.x)) {
        p.partial_max[partial_index + int64_t{j} * p.num_partitions] = max_logit[j];
        p.partial_sum[partial_index + int64_t{j} * p.num_partitions] = exp_sum[j];
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kAttentionThreads) paged_attention_reduce_kernel(const AttentionParams p) {
  constexpr int kNumWarps = kAttentionThreads / kWarpSize;
  __shared__ float red_smem[kNumWarps];
  extern __shared__ float weights[];  // [num_partitions]

  const int head = static_cast<int>(blockIdx.x % p.num_heads);
  const int64_t row = blockIdx.x / p.num_heads;
  const int64_t out_index = row * p.num_heads + head;
  T* out = static_cast<T*>(p.out) + out_index * p.head_size;
  const AttentionRow r = resolve_row(p, row);
  const int read = r.context_len - window_read_begin(p.sliding_window, p.block_size, r.context_len);
  const int num_parts = read > 0 ? (read + p.partition_size - 1) / p.partition_size : 0;
  if (num_parts == 0) {
    for (int d = threadIdx.x; d < p.head_size; d += kAttentionThreads) out[d] = from_float<T>(0.0f);
    return;
  }
  const int64_t base = out_index * p.num_partitions;

  float m = -INFINITY;
  for (int i = threadIdx.x; i < num_parts; i += kAttentionThreads) m = fmaxf(m, p.partial_max[base + i]);
  m = block_max<kNumWarps>(m, red_smem);
  float local_sum = 0.0f;
  for (int i = threadIdx.x; i < num_parts; i += kAttentionThreads) {
    const float w = expf(p.partial_max[base + i] - m);
    weights[i] = w;
    local_sum += w * p.partial_sum[base + i];
  }
  const float inv_sum = __fdividef(1.0f, block_sum<kNumWarps>(local_sum, red_smem));

  const float* partial = p.partial_out + base * p.head_size;
  for (int d = threadIdx.x; d < p.head_size; d += kAttentionThreads) {
    float v = 0.0f;
    for (int i = 0; i < num_parts; ++i) v = fmaf(partial[int64_t{i} * p.head_size + d], weights[i], v);
    out[d] = from_float<T>(v * inv_sum);
  }
}

template <typename T, int kHeadSize, int kBlockSize, int kGroup>
cudaError_t launch_attention(const AttentionParams& p, cudaStream_t stream) {
  const auto kernel = paged_attention_kernel<T, kHeadSize, kBlockSize, kGroup>;
  const size_t smem = static_cast<size_t>(kGroup) * p.partition_size * sizeof(float);
  constexpr size_t kDefaultSmem = 48 * 1024;
  if (smem > kDefaultSmem) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const int64_t head_blocks = int64_t{p.num_kv_heads} * p.group_chunks;
  const dim3 grid(static_cast<unsigned>(p.num_rows * head_blocks), 1, static_cast<unsigned>(p.num_partitions));
  kernel<<<grid, kAttentionThreads, smem, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || !p.split) return err;
  const auto reduce_blocks = static_cast<unsigned>(p.num_rows * p.num_heads);
  paged_attention_reduce_kernel<T><<<reduce_blocks, kAttentionThreads, p.num_partitions * sizeof(float), stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int kHeadSize, int kBlockSize>
cudaError_t launch_attention_for_block(const AttentionParams& p, cudaStream_t stream) {
  switch (p.heads_per_block) {
    case 1: return launch_attention<T, kHeadSize, kBlockSize, 1>(p, stream);
    case 2: return launch_attention<T, kHeadSize, kBlockSize, 2>(p, stream);
    case 4: return launch_attention<T, kHeadSize, kBlockSize, 4>(p, stream);
    case 8: return launch_attention<T, kHeadSize, kBlockSize, 8>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T, int kHeadSize>
cudaError_t launch_attention_for_head(const AttentionParams& p, cudaStream_t stream) {
  switch (p.block_size) {
    case 8: return launch_attention_for_block<T, kHeadSize, 8>(p, stream);
    case 16: return launch_attention_for_block<T, kHeadSize, 16>(p, stream);
    case 32: return launch_attention_for_block<T, kHeadSize, 32>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

// Definition of the launcher declared in attention_params.h.
template <typename T>
cudaError_t launch_paged_attention_typed(const AttentionParams& p, cudaStream_t stream) {
  switch (p.head_size) {
    case 64: return launch_attention_for_head<T, 64>(p, stream);
    case 80: return launch_attention_for_head<T, 80>(p, stream);
    case 96: return launch_attention_for_head<T, 96>(p, stream);
    case 128: return launch_attention_for_head<T, 128>(p, stream);
    case 256: return launch_attention_for_head<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace vpage::cuda::detail
