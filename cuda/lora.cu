// Batched multi-LoRA (vpage/cuda/lora.h), in two launches on one stream:
//  1. shrink: grid (token, group of kShrinkWarps rows of A); each warp one row of its token's
//     adapter A [num_slices * rank, k]: lanes stride over k eight values at a time (16-byte loads
//     where x, A and their row strides allow, else one value at a time), a float32 dot product
//     met by a warp-shuffle sum, written to the workspace T [m, num_slices * max_rank].
//  2. expand: grid (token, tile of kExpandThreads output columns); each thread one column c of
//     slice j: out[t, c] += T[t, j rank : (j + 1) rank] . B_j[c - off_j], the sum in float32
//     over the contiguous B row, rounded once to out's dtype.
// Both read the slot table on the device and skip a row whose slot is -1 (or out of range) or has
// no A, so the grids are sized from m and max_rank alone and nothing is read back to the host.
// Every sum of a row runs in a fixed order: a row's result does not depend on the other rows.
#include "vpage/cuda/lora.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "dtype_utils.cuh"

namespace vpage::cuda {
namespace {

using detail::from_float;
using detail::kWarpSize;
using detail::to_float;
using detail::warp_sum;

constexpr int kShrinkWarps = 4;
constexpr int kShrinkThreads = kShrinkWarps * kWarpSize;
constexpr int kExpandThreads = 256;
constexpr int kVec = 8;  // values per vector step: one 16-byte load of a 16-bit type, two of float32
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMaxGridX = 2147483647;

/// Output column offsets of the slices: slice j starts at offset[j]; past the last slice every
/// offset is n (the projection's output columns), so offset[kMaxLoraSlices] == n.
struct Slices {
  int32_t offset[kMaxLoraSlices + 1];
};

/// The eight values at `p` (16-byte aligned) as float.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[kVec]) {
  constexpr int kPer = detail::kPack<T>;  // 4 (float32) or 8 (16-bit)
#pragma unroll
  for (int h = 0; h < kVec / kPer; ++h) {
    float part[kPer];
    detail::load_pack<T>(p + h * kPer, part);
#pragma unroll
    for (int i = 0; i < kPer; ++i) v[h * kPer + i] = part[i];
  }
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

/// The adapter of token t, or nullptr when the token has none (slot -1 or out of range, no A,
/// a rank outside [1, max_rank]). Uniform over a thread block.
__device__ __forceinline__ const LoraAdapterWeights* token_adapter(const int32_t* token_slots, int64_t t,
                                                                  const LoraAdapterWeights* slots, int32_t num_slots,
                                                                  int32_t max_rank) {
  const int32_t slot = token_slots[t];
  if (slot < 0 || slot >= num_slots) return nullptr;
  const LoraAdapterWeights* w = slots + slot;
  return w->a == nullptr || w->rank < 1 || w->rank > max_rank ? nullptr : w;
}

// T[t, row] = x[t] . A[row] for the rows of the token's adapter; see the file comment.
// x_vec: x's rows and A's rows (k values apart) may be read with 16-byte loads (A's base still
// checked here).
template <typename T, typename W>
__global__ void __launch_bounds__(kShrinkThreads)
    lora_shrink_kernel(float* shrunk, int64_t shrunk_stride, const T* x, int64_t x_stride, int32_t k,
                       const int32_t* token_slots, const LoraAdapterWeights* slots, int32_t num_slots,
                       int32_t num_slices, int32_t max_rank, bool x_vec) {
  const int64_t t = blockIdx.x;
  const LoraAdapterWeights* w = token_adapter(token_slots, t, slots, num_slots, max_rank);
  if (w == nullptr) return;
  const int32_t rank = static_cast<int32_t>(w->rank);
  const int32_t lane = threadIdx.x % kWarpSize;
  const int32_t row = blockIdx.y * kShrinkWarps + threadIdx.x / kWarpSize;
  if (row >= num_slices * rank) return;  // whole warps: no block-wide sync below
  const T* xr = x + t * x_stride;
  const W* a = static_cast<const W*>(w->a) + static_cast<int64_t>(row) * k;
  float acc = 0.0f;
  int32_t done = 0;
  if (x_vec && aligned16(w->a)) {
    done = k / kVec * kVec;
    for (int32_t c = lane * kVec; c < done; c += kWarpSize * kVec) {
      float xv[kVec], av[kVec];
      load8<T>(xr + c, xv);
      load8<W>(a + c, av);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc = fmaf(xv[i], av[i], acc);
    }
  }
  for (int32_t c = done + lane; c < k; c += kWarpSize) acc = fmaf(to_float(xr[c]), to_float(a[c]), acc);
  acc = warp_sum(acc);
  if (lane == 0) shrunk[t * shrunk_stride + row] = acc;
}

// out[t, c] += T[t, slice j of the rank] . B_j[c - off_j]; see the file comment.
template <typename T, typename W>
__global__ void __launch_bounds__(kExpandThreads)
    lora_expand_kernel(T* out, int64_t out_stride, const float* shrunk, int64_t shrunk_stride,
                       const int32_t* token_slots, const LoraAdapterWeights* slots, int32_t num_slots, Slices slices,
                       int32_t max_rank) {
  const int64_t t = blockIdx.x;
  const LoraAdapterWeights* w = token_adapter(token_slots, t, slots, num_slots, max_rank);
  if (w == nullptr) return;
  const int32_t c = blockIdx.y * kExpandThreads + threadIdx.x;
  if (c >= slices.offset[kMaxLoraSlices]) return;
  static_assert(kMaxLoraSlices == 3, "the slice lookup below knows three slices");
  const int j = (c >= slices.offset[1]) + (c >= slices.offset[2]);  // selects, no indexed parameter array
  const int32_t start = j == 0 ? 0 : (j == 1 ? slices.offset[1] : slices.offset[2]);
  const W* b_base = static_cast<const W*>(j == 0 ? w->b[0] : (j == 1 ? w->b[1] : w->b[2]));
  if (b_base == nullptr) return;  // slice left alone
  const int32_t rank = static_cast<int32_t>(w->rank);
  const W* b = b_base + static_cast<int64_t>(c - start) * rank;
  const float* s = shrunk + t * shrunk_stride + static_cast<int64_t>(j) * rank;  // same address across a warp
  float acc = 0.0f;
  int32_t done = 0;
  if (aligned16(b_base) && (rank * static_cast<int32_t>(sizeof(W))) % 16 == 0) {
    done = rank / kVec * kVec;
    for (int32_t r = 0; r < done; r += kVec) {
      float bv[kVec];
      load8<W>(b + r, bv);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc = fmaf(s[r + i], bv[i], acc);
    }
  }
  for (int32_t r = done; r < rank; ++r) acc = fmaf(s[r], to_float(b[r]), acc);
  T* o = out + t * out_stride + c;
  *o = from_float<T>(to_float(*o) + acc);
}

/// Whether rows `row_bytes` apart from `p` all start on 16 bytes.
bool rows_aligned16(const void* p, int64_t row_bytes) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0 && row_bytes % 16 == 0;
}

/// Runs launch(T{}) for the element type of `dtype`.
template <typename Launch>
cudaError_t for_dtype(DType dtype, Launch launch) {
  switch (dtype) {
    case DType::kFloat32: return launch(float{});
    case DType::kFloat16: return launch(__half{});
    case DType::kBFloat16: return launch(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

size_t lora_add_workspace_bytes(int64_t m, int32_t num_slices, int32_t max_rank) {
  if (m <= 0 || num_slices <= 0 || max_rank <= 0) return 0;
  return static_cast<size_t>(m) * static_cast<size_t>(num_slices) * static_cast<size_t>(max_rank) * sizeof(float);
}

cudaError_t lora_add(const LoraArgs& args, int32_t max_rank, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  if (args.m < 0 || args.k <= 0 || args.num_slices < 1 || args.num_slices > kMaxLoraSlices || args.num_slots < 0 ||
      max_rank < 0 || args.m > kMaxGridX)
    return cudaErrorInvalidValue;
  Slices slices{};
  int64_t n = 0;
  for (int j = 0; j < args.num_slices; ++j) {
    if (args.slice_rows[j] <= 0) return cudaErrorInvalidValue;
    n += args.slice_rows[j];
    if (n > INT32_MAX) return cudaErrorInvalidValue;
    slices.offset[j + 1] = static_cast<int32_t>(n);
  }
  for (int j = args.num_slices + 1; j <= kMaxLoraSlices; ++j) slices.offset[j] = static_cast<int32_t>(n);
  if (args.x_stride < args.k || args.out_stride < n) return cudaErrorInvalidValue;
  if (args.m == 0 || args.num_slots == 0 || max_rank == 0) return cudaSuccess;  // no row can have an adapter
  if (args.out == nullptr || args.x == nullptr || args.token_slots == nullptr || args.slots == nullptr ||
      workspace == nullptr || workspace_bytes < lora_add_workspace_bytes(args.m, args.num_slices, max_rank))
    return cudaErrorInvalidValue;
  const int64_t shrink_groups = (static_cast<int64_t>(args.num_slices) * max_rank + kShrinkWarps - 1) / kShrinkWarps;
  const int64_t column_tiles = (n + kExpandThreads - 1) / kExpandThreads;
  if (shrink_groups > kMaxGridY || column_tiles > kMaxGridY) return cudaErrorInvalidValue;

  const int64_t shrunk_stride = static_cast<int64_t>(args.num_slices) * max_rank;
  float* shrunk = static_cast<float*>(workspace);
  const dim3 shrink_grid(static_cast<unsigned>(args.m), static_cast<unsigned>(shrink_groups));
  const dim3 expand_grid(static_cast<unsigned>(args.m), static_cast<unsigned>(column_tiles));
  return for_dtype(args.dtype, [&](auto act) {
    using T = decltype(act);
    const bool x_vec = rows_aligned16(args.x, args.x_stride * static_cast<int64_t>(sizeof(T))) &&
                       (static_cast<int64_t>(args.k) * dtype_size(args.weight_dtype)) % 16 == 0;
    return for_dtype(args.weight_dtype, [&](auto weight) {
      using W = decltype(weight);
      lora_shrink_kernel<T, W><<<shrink_grid, kShrinkThreads, 0, stream>>>(
          shrunk, shrunk_stride, static_cast<const T*>(args.x), args.x_stride, args.k, args.token_slots, args.slots,
          args.num_slots, args.num_slices, max_rank, x_vec);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      lora_expand_kernel<T, W><<<expand_grid, kExpandThreads, 0, stream>>>(
          static_cast<T*>(args.out), args.out_stride, shrunk, shrunk_stride, args.token_slots, args.slots,
          args.num_slots, slices, max_rank);
      return cudaGetLastError();
    });
  });
}

}  // namespace vpage::cuda
