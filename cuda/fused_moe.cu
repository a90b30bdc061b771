// fused_moe on the GPU, in six launches on one stream:
//  1. route: one block per token; softmax over the router logits and the top-k (thread 0 of
//     the block, experts in shared memory), or the given ids; counts the pairs of each expert.
//  2. offsets: one thread; each expert's rows start on a multiple of kTileRows.
//  3. scatter: one thread per (token, choice) pair: its row in its expert's segment.
//  4. gate/up: blocks of (kTileRows rows of one expert, kTileCols intermediate columns); the
//     block stages x rows and both weight tiles kTileK values at a time in shared memory, each
//     thread accumulates one row x kColsPerThread columns in float32, then silu(gate) * up.
//  5. down: the same tiling over the float32 activations and the down weights.
//  6. combine: one block per token, its top-k rows weighted and summed in top-k order.
// Tiles past the last expert's rows exit at once, so the grid is sized without reading the
// counts back (the launches can be captured in a CUDA graph).
#include "vpage/cuda/fused_moe.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "dtype_utils.cuh"

namespace vpage::cuda {
namespace {

using detail::from_float;
using detail::to_float;

constexpr int kTileRows = 16;
constexpr int kTileCols = 64;
constexpr int kTileK = 32;
constexpr int kThreads = 256;
constexpr int kColsPerThread = kTileRows * kTileCols / kThreads;  // 4
constexpr int kRouteThreads = 128;
constexpr size_t kAlign = 256;

size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Rows of the padded, grouped layout: every pair plus each expert's padding.
int64_t padded_rows(int64_t m, int32_t top_k, int32_t num_experts) {
  const int64_t rows = m * top_k + static_cast<int64_t>(num_experts) * (kTileRows - 1);
  return (rows + kTileRows - 1) / kTileRows * kTileRows;
}

// The workspace's parts.
struct Workspace {
  int32_t* ids;        // [m * top_k]
  float* weights;      // [m * top_k]
  int32_t* counts;     // [num_experts]
  int32_t* start;      // [num_experts + 1], padded segment starts; start[E] = rows in use
  int32_t* cursor;     // [num_experts]
  int32_t* row_of;     // [m * top_k]: the grouped row of each pair
  int32_t* row_token;  // [rows]: the token of each grouped row, -1 for padding
  float* act;          // [rows, intermediate]
  float* y;            // [rows, hidden]
  size_t bytes;
};

Workspace carve(void* base, int64_t m, int32_t top_k, int32_t num_experts, int32_t hidden, int32_t intermediate) {
  Workspace w{};
  char* p = static_cast<char*>(base);
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    char* at = p == nullptr ? nullptr : p + offset;
    offset += aligned(bytes);
    return at;
  };
  const int64_t pairs = m * top_k, rows = padded_rows(m, top_k, num_experts);
  w.ids = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * pairs));
  w.weights = reinterpret_cast<float*>(take(sizeof(float) * pairs));
  w.counts = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * num_experts));
  w.start = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * (num_experts + 1)));
  w.cursor = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * num_experts));
  w.row_of = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * pairs));
  w.row_token = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * rows));
  w.act = reinterpret_cast<float*>(take(sizeof(float) * rows * intermediate));
  w.y = reinterpret_cast<float*>(take(sizeof(float) * rows * hidden));
  w.bytes = offset;
  return w;
}

__global__ void route_kernel(const FusedMoeArgs a, Workspace w) {
  extern __shared__ float probs[];  // [num_experts]
  const int64_t t = blockIdx.x;
  int32_t* ids = w.ids + t * a.top_k;
  float* weights = w.weights + t * a.top_k;
  if (a.router_logits == nullptr) {
    for (int j = threadIdx.x; j < a.top_k; j += blockDim.x) {
      ids[j] = a.topk_ids[t * a.top_k + j];
      weights[j] = a.topk_weights[t * a.top_k + j];
      atomicAdd(&w.counts[ids[j]], 1);
    }
    return;
  }
  const float* logits = a.router_logits + t * a.num_experts;
  for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x) probs[e] = logits[e];
  __syncthreads();
  if (threadIdx.x != 0) return;
  float max = probs[0];
  for (int e = 1; e < a.num_experts; ++e) max = fmaxf(max, probs[e]);
  float sum = 0.0f;
  for (int e = 0; e < a.num_experts; ++e) sum += probs[e] = expf(probs[e] - max);
  float chosen = 0.0f;
  for (int j = 0; j < a.top_k; ++j) {
    int best = -1;
    for (int e = 0; e < a.num_experts; ++e) {
      if (probs[e] >= 0.0f && (best < 0 || probs[e] > probs[best])) best = e;
    }
    ids[j] = best;
    weights[j] = probs[best] / sum;
    chosen += weights[j];
    probs[best] = -1.0f;
    atomicAdd(&w.counts[best], 1);
  }
  if (a.renormalize) {
    for (int j = 0; j < a.top_k; ++j) weights[j] /= chosen;
  }
}

__global__ void offsets_kernel(int32_t num_experts, Workspace w) {
  int32_t at = 0;
  for (int e = 0; e < num_experts; ++e) {
    w.start[e] = at;
    w.cursor[e] = at;
    at += (w.counts[e] + kTileRows - 1) / kTileRows * kTileRows;
  }
  w.start[num_experts] = at;
}

__global__ void scatter_kernel(int64_t pairs, int32_t top_k, Workspace w) {
  const int64_t p = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (p >= pairs) return;
  const int32_t row = atomicAdd(&w.cursor[w.ids[p]], 1);
  w.row_of[p] = row;
  w.row_token[row] = static_cast<int32_t>(p / top_k);
}

// The expert whose segment holds grouped row `row` (< start[num_experts]).
__device__ int expert_of(const int32_t* start, int32_t num_experts, int32_t row) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {  // the last expert whose start <= row
    const int mid = (lo + hi + 1) / 2;
    if (start[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// acc[c] += sum over k of rows' x[r, k] * W[col c, k] for the block's tile: x row r of the tile
// is x_row(r) (nullptr: padding), W [n, k_total] row-major.
template <int kMats, typename TX, typename TW, typename XRow>
__device__ void tile_matmul(XRow x_row, const TW* const (&weights)[kMats], int32_t n, int32_t k_total, int32_t col0,
                            float (&acc)[kMats][kColsPerThread]) {
  __shared__ float xs[kTileRows][kTileK];
  __shared__ float ws[kMats][kTileCols][kTileK + 1];
  const int r = threadIdx.x / (kTileCols / kColsPerThread);
  const int c = threadIdx.x % (kTileCols / kColsPerThread);
  for (int32_t k0 = 0; k0 < k_total; k0 += kTileK) {
    for (int i = threadIdx.x; i < kTileRows * kTileK; i += kThreads) {
      const int rr = i / kTileK, kk = i % kTileK;
      const TX* row = x_row(rr);
      xs[rr][kk] = row != nullptr && k0 + kk < k_total ? to_float(row[k0 + kk]) : 0.0f;
    }
    for (int mat = 0; mat < kMats; ++mat) {
      for (int i = threadIdx.x; i < kTileCols * kTileK; i += kThreads) {
        const int cc = i / kTileK, kk = i % kTileK;
        const bool in = col0 + cc < n && k0 + kk < k_total;
        ws[mat][cc][kk] = in ? to_float(weights[mat][static_cast<int64_t>(col0 + cc) * k_total + k0 + kk]) : 0.0f;
      }
    }
    __syncthreads();
#pragma unroll 4
    for (int kk = 0; kk < kTileK; ++kk) {
      const float xv = xs[r][kk];
#pragma unroll
      for (int mat = 0; mat < kMats; ++mat) {
#pragma unroll
        for (int j = 0; j < kColsPerThread; ++j) acc[mat][j] += xv * ws[mat][c + j * (kTileCols / kColsPerThread)][kk];
      }
    }
    __syncthreads();
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) gate_up_kernel(const FusedMoeArgs a, Workspace w) {
  const int32_t row0 = blockIdx.x * kTileRows;
  if (row0 >= w.start[a.num_experts]) return;
  const int e = expert_of(w.start, a.num_experts, row0);
  const int32_t col0 = blockIdx.y * kTileCols;
  const T* x = static_cast<const T*>(a.x);
  const T* const mats[2] = {
      reinterpret_cast<const T*>(static_cast<const char*>(a.w1.data) + e * a.w1.expert_bytes),
      reinterpret_cast<const T*>(static_cast<const char*>(a.w3.data) + e * a.w3.expert_bytes)};
  auto x_row = [&](int r) -> const T* {
    const int32_t token = w.row_token[row0 + r];
    return token < 0 ? nullptr : x + token * a.x_stride;
  };
  float acc[2][kColsPerThread] = {};
  tile_matmul<2, T>(x_row, mats, a.intermediate, a.hidden, col0, acc);
  const int r = threadIdx.x / (kTileCols / kColsPerThread);
  const int c = threadIdx.x % (kTileCols / kColsPerThread);
  for (int j = 0; j < kColsPerThread; ++j) {
    const int32_t col = col0 + c + j * (kTileCols / kColsPerThread);
    if (col < a.intermediate) {
      const float g = acc[0][j];
      w.act[static_cast<int64_t>(row0 + r) * a.intermediate + col] = g / (1.0f + expf(-g)) * acc[1][j];
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) down_kernel(const FusedMoeArgs a, Workspace w) {
  const int32_t row0 = blockIdx.x * kTileRows;
  if (row0 >= w.start[a.num_experts]) return;
  const int e = expert_of(w.start, a.num_experts, row0);
  const int32_t col0 = blockIdx.y * kTileCols;
  const T* const mats[1] = {reinterpret_cast<const T*>(static_cast<const char*>(a.w2.data) + e * a.w2.expert_bytes)};
  auto act_row = [&](int r) -> const float* { return w.act + static_cast<int64_t>(row0 + r) * a.intermediate; };
  float acc[1][kColsPerThread] = {};
  tile_matmul<1, float>(act_row, mats, a.hidden, a.intermediate, col0, acc);
  const int r = threadIdx.x / (kTileCols / kColsPerThread);
  const int c = threadIdx.x % (kTileCols / kColsPerThread);
  for (int j = 0; j < kColsPerThread; ++j) {
    const int32_t col = col0 + c + j * (kTileCols / kColsPerThread);
    if (col < a.hidden) w.y[static_cast<int64_t>(row0 + r) * a.hidden + col] = acc[0][j];
  }
}

template <typename T>
__global__ void combine_kernel(const FusedMoeArgs a, Workspace w) {
  const int64_t t = blockIdx.x;
  T* out = static_cast<T*>(a.out) + t * a.out_stride;
  for (int32_t col = threadIdx.x; col < a.hidden; col += blockDim.x) {
    float sum = 0.0f;
    for (int j = 0; j < a.top_k; ++j) {
      const int64_t p = t * a.top_k + j;
      sum += w.weights[p] * w.y[static_cast<int64_t>(w.row_of[p]) * a.hidden + col];
    }
    out[col] = from_float<T>(sum);
  }
}

bool valid(const FusedMoeArgs& a) {
  const bool plain = !a.w1.quantized && !a.w3.quantized && !a.w2.quantized && a.w1.dtype == a.dtype &&
                     a.w3.dtype == a.dtype && a.w2.dtype == a.dtype;
  return plain && a.m >= 0 && a.hidden > 0 && a.intermediate > 0 && a.num_experts > 0 && a.top_k >= 1 &&
         a.top_k <= a.num_experts && a.x_stride >= a.hidden && a.out_stride >= a.hidden &&
         (a.m == 0 || (a.x != nullptr && a.out != nullptr && a.w1.data != nullptr && a.w3.data != nullptr &&
                       a.w2.data != nullptr &&
                       (a.router_logits != nullptr || (a.topk_ids != nullptr && a.topk_weights != nullptr))));
}

template <typename T>
cudaError_t launch_matmuls(const FusedMoeArgs& a, const Workspace& w, cudaStream_t stream) {
  const unsigned tiles = static_cast<unsigned>(padded_rows(a.m, a.top_k, a.num_experts) / kTileRows);
  gate_up_kernel<T><<<dim3(tiles, (a.intermediate + kTileCols - 1) / kTileCols), kThreads, 0, stream>>>(a, w);
  down_kernel<T><<<dim3(tiles, (a.hidden + kTileCols - 1) / kTileCols), kThreads, 0, stream>>>(a, w);
  combine_kernel<T><<<static_cast<unsigned>(a.m), kThreads, 0, stream>>>(a, w);
  return cudaGetLastError();
}

}  // namespace

size_t fused_moe_workspace_bytes(int64_t m, int32_t top_k, int32_t num_experts, int32_t hidden,
                                 int32_t intermediate) {
  return carve(nullptr, m, top_k, num_experts, hidden, intermediate).bytes;
}

cudaError_t fused_moe(const FusedMoeArgs& args, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (!valid(args)) return cudaErrorInvalidValue;
  if (args.m == 0) return cudaSuccess;
  const Workspace w = carve(workspace, args.m, args.top_k, args.num_experts, args.hidden, args.intermediate);
  if (workspace == nullptr || workspace_bytes < w.bytes) return cudaErrorInvalidValue;
  cudaError_t err = cudaMemsetAsync(w.counts, 0, sizeof(int32_t) * args.num_experts, stream);
  if (err == cudaSuccess) {
    err = cudaMemsetAsync(w.row_token, 0xff, sizeof(int32_t) * padded_rows(args.m, args.top_k, args.num_experts),
                          stream);
  }
  if (err != cudaSuccess) return err;
  route_kernel<<<static_cast<unsigned>(args.m), kRouteThreads, sizeof(float) * args.num_experts, stream>>>(args, w);
  offsets_kernel<<<1, 1, 0, stream>>>(args.num_experts, w);
  const int64_t pairs = args.m * args.top_k;
  scatter_kernel<<<static_cast<unsigned>((pairs + kThreads - 1) / kThreads), kThreads, 0, stream>>>(pairs, args.top_k,
                                                                                                    w);
  switch (args.dtype) {
    case DType::kFloat32: return launch_matmuls<float>(args, w, stream);
    case DType::kFloat16: return launch_matmuls<__half>(args, w, stream);
    case DType::kBFloat16: return launch_matmuls<__nv_bfloat16>(args, w, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace vpage::cuda
