// The paged attention kernels, templated on dtype, head size and block size. Included by
// paged_attention_{f32,f16,bf16}.cu, each of which instantiates one dtype.
//
// Grid and threads (both kernels): blockIdx.x = row * num_heads + head, where a row is a
// sequence (decode) or a query token (prefill); blockIdx.z = partition of the context.
// Heads of one GQA group are neighbouring thread blocks, so their shared K/V blocks are
// read from DRAM once and then served by L2. 128 threads = 4 warps per thread block.
//
// paged_attention_kernel, per (row, head, partition) of up to partition_size tokens:
//  1. q (times scale) -> shared memory as float.
//  2. Logits: warp w walks the KV blocks w, w + 4, ... of the partition. In one step a warp
//     covers a whole KV block: lane -> token lane % block_size and 16-byte key fragments
//     lane / block_size, + 32 / block_size, ...; one load instruction of the warp reads 512
//     contiguous bytes. Partial dot products meet by shuffles; logits -> shared memory.
//  3. Softmax in fp32 over the partition (block-wide max and sum).
//  4. Values: a warp again covers one KV block per step: lane -> 16-byte token chunk
//     lane % c (+ c, ...) of head-dim rows lane / c + k * (32 / c), where c = block_size / x
//     chunks per row (capped at 4 for head size 256 so that a lane keeps <= 32 fp32
//     accumulators); then shuffles across the c lanes and shared memory across warps.
//  v1 (one partition) normalises and writes `out`; v2 writes the unnormalised partial
//  output, its max logit and exp sum to the workspace for paged_attention_reduce_kernel.
// Tokens past the context are never loaded: their keys are skipped, chunks of values past
// the end are skipped, and the one chunk that crosses the end is read element by element.
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

template <typename T, int kHeadSize, int kBlockSize>
__global__ void __launch_bounds__(kAttentionThreads) paged_attention_kernel(const AttentionParams p) {
  constexpr int kX = kPack<T>;
  constexpr int kNumWarps = kAttentionThreads / kWarpSize;
  constexpr int kKeyFrags = kHeadSize / kX;
  constexpr int kLanesPerToken = kWarpSize / kBlockSize;
  constexpr int kFragsPerLane = (kKeyFrags + kLanesPerToken - 1) / kLanesPerToken;
  constexpr int kValueChunks = kBlockSize / kX;
  // Lanes per head-dim row; at most 4 when that keeps the fp32 accumulators <= 32 per lane.
  constexpr int kLaneChunks = kHeadSize * kValueChunks > kWarpSize * 32 ? 4 : kValueChunks;
  constexpr int kRowsPerPass = kWarpSize / kLaneChunks;
  constexpr int kRowsPerLane = (kHeadSize + kRowsPerPass - 1) / kRowsPerPass;
  constexpr int64_t kHeadElems = int64_t{kHeadSize} * kBlockSize;
  static_assert(kHeadSize % kX == 0 && kBlockSize % kX == 0 && kWarpSize % kBlockSize == 0);

  __shared__ float q_smem[kHeadSize];
  __shared__ float red_smem[kNumWarps];
  __shared__ float out_smem[kNumWarps][kHeadSize];
  extern __shared__ float logits[];  // [partition_size]

  const int head = static_cast<int>(blockIdx.x % p.num_heads);
  const int64_t row = blockIdx.x / p.num_heads;
  const int partition = static_cast<int>(blockIdx.z);
  const int64_t out_index = row * p.num_heads + head;
  const AttentionRow r = resolve_row(p, row);
  const int window_begin = p.sliding_window > 0 ? max(0, r.context_len - p.sliding_window) : 0;
  const int start = window_read_begin(p.sliding_window, kBlockSize, r.context_len) + partition * p.partition_size;
  if (start >= r.context_len) {
    if (!p.split && r.context_len <= 0) {
      T* out = static_cast<T*>(p.out) + out_index * kHeadSize;
      for (int d = threadIdx.x; d < kHeadSize; d += kAttentionThreads) out[d] = from_float<T>(0.0f);
    }
    return;
  }
  const int end = min(start + p.partition_size, r.context_len);
  const int first_block = start / kBlockSize;
  const int end_block = (end + kBlockSize - 1) / kBlockSize;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int32_t* block_table = p.block_tables + int64_t{r.seq} * p.max_blocks_per_seq;
  const int64_t block_stride = p.num_kv_heads * kHeadElems;
  const T* key_cache = static_cast<const T*>(p.key_cache) + kv_head * kHeadElems;
  const T* value_cache = static_cast<const T*>(p.value_cache) + kv_head * kHeadElems;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;

  const T* query = static_cast<const T*>(p.query) + row * p.query_stride + head * kHeadSize;
  for (int i = threadIdx.x; i < kHeadSize; i += kAttentionThreads) {
    q_smem[i] = to_float(query[i]) * p.scale;
  }
  __syncthreads();

  const int token_in_block = lane % kBlockSize;
  const int frag_group = lane / kBlockSize;
  float max_logit = -INFINITY;
  for (int b = first_block + warp; b < end_block; b += kNumWarps) {
    const int token = b * kBlockSize + token_in_block;
    float qk = 0.0f;
    if (token < end) {
      const T* key = key_cache + block_table[b] * block_stride + token_in_block * kX;
#pragma unroll 8  // bounds live key fragments (head 256 fp32 has 64 per lane)
      for (int i = 0; i < kFragsPerLane; ++i) {
        const int f = frag_group + i * kLanesPerToken;
        if (kKeyFrags % kLanesPerToken == 0 || f < kKeyFrags) {
          float k[kX];
          load_pack(key + f * (kBlockSize * kX), k);
#pragma unroll
          for (int j = 0; j < kX; ++j) qk = fmaf(q_smem[f * kX + j], k[j], qk);
        }
      }
    }
#pragma unroll
    for (int mask = kBlockSize; mask < kWarpSize; mask <<= 1) qk += __shfl_xor_sync(kFullMask, qk, mask);
    if (token < end) {
      if (p.soft_cap > 0.0f) qk = p.soft_cap * tanhf(qk * p.inv_soft_cap);
      if (token < window_begin) qk = -INFINITY;  // only in the window's first block
      if (frag_group == 0) logits[token - start] = qk;
      max_logit = fmaxf(max_logit, qk);
    }
  }
  const float m = block_max<kNumWarps>(max_logit, red_smem);

  const int num_tokens = end - start;
  float local_sum = 0.0f;
  for (int i = threadIdx.x; i < num_tokens; i += kAttentionThreads) {
    const float e = expf(logits[i] - m);
    logits[i] = e;
    local_sum += e;
  }
  const float exp_sum = block_sum<kNumWarps>(local_sum, red_smem);

  const int lane_chunk = lane % kLaneChunks;
  const int row_in_pass = lane / kLaneChunks;
  float acc[kRowsPerLane];
#pragma unroll
  for (int i = 0; i < kRowsPerLane; ++i) acc[i] = 0.0f;
  for (int b = first_block + warp; b < end_block; b += kNumWarps) {
    const T* value_block = value_cache + block_table[b] * block_stride;
#pragma unroll
    for (int chunk = lane_chunk; chunk < kValueChunks; chunk += kLaneChunks) {
      const int token0 = b * kBlockSize + chunk * kX;
      float prob[kX];
#pragma unroll
      for (int j = 0; j < kX; ++j) prob[j] = token0 + j < end ? logits[token0 + j - start] : 0.0f;
      const T* value = value_block + chunk * kX;
      if (token0 + kX <= end) {
#pragma unroll
        for (int i = 0; i < kRowsPerLane; ++i) {
          const int d = row_in_pass + i * kRowsPerPass;
          if (kHeadSize % kRowsPerPass == 0 || d < kHeadSize) {
            float v[kX];
            load_pack(value + d * kBlockSize, v);
#pragma unroll
            for (int j = 0; j < kX; ++j) acc[i] = fmaf(prob[j], v[j], acc[i]);
          }
        }
      } else if (token0 < end) {
        // The chunk crossing the context end: element loads of the valid tokens only.
        const int num_valid = end - token0;
#pragma unroll
        for (int i = 0; i < kRowsPerLane; ++i) {
          const int d = row_in_pass + i * kRowsPerPass;
          if (kHeadSize % kRowsPerPass == 0 || d < kHeadSize) {
#pragma unroll
            for (int j = 0; j < kX; ++j) {
              if (j < num_valid) acc[i] = fmaf(prob[j], to_float(value[d * kBlockSize + j]), acc[i]);
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerLane; ++i) {
#pragma unroll
    for (int mask = 1; mask < kLaneChunks; mask <<= 1) acc[i] += __shfl_xor_sync(kFullMask, acc[i], mask);
    const int d = row_in_pass + i * kRowsPerPass;
    if (lane_chunk == 0 && (kHeadSize % kRowsPerPass == 0 || d < kHeadSize)) out_smem[warp][d] = acc[i];
  }
  __syncthreads();

  const int64_t partial_index = out_index * p.num_partitions + partition;
  const float inv_sum = __fdividef(1.0f, exp_sum);  // exp_sum is in [1, partition_size]
  for (int d = threadIdx.x; d < kHeadSize; d += kAttentionThreads) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) v += out_smem[w][d];
    if (p.split) {
      p.partial_out[partial_index * kHeadSize + d] = v;
    } else {
      static_cast<T*>(p.out)[out_index * kHeadSize + d] = from_float<T>(v * inv_sum);
    }
  }
  if (p.split && threadIdx.x == 0) {
    p.partial_max[partial_index] = m;
    p.partial_sum[partial_index] = exp_sum;
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

template <typename T, int kHeadSize, int kBlockSize>
cudaError_t launch_attention(const AttentionParams& p, cudaStream_t stream) {
  const auto kernel = paged_attention_kernel<T, kHeadSize, kBlockSize>;
  const size_t smem = static_cast<size_t>(p.partition_size) * sizeof(float);
  constexpr size_t kDefaultSmem = 48 * 1024;
  if (smem > kDefaultSmem) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(static_cast<unsigned>(p.num_rows * p.num_heads), 1, static_cast<unsigned>(p.num_partitions));
  kernel<<<grid, kAttentionThreads, smem, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || !p.split) return err;
  paged_attention_reduce_kernel<T><<<grid.x, kAttentionThreads, p.num_partitions * sizeof(float), stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int kHeadSize>
cudaError_t launch_attention_for_head(const AttentionParams& p, cudaStream_t stream) {
  switch (p.block_size) {
    case 8: return launch_attention<T, kHeadSize, 8>(p, stream);
    case 16: return launch_attention<T, kHeadSize, 16>(p, stream);
    case 32: return launch_attention<T, kHeadSize, 32>(p, stream);
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
