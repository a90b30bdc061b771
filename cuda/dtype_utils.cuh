// Device helpers shared by the kernels: element conversion, 16-byte loads, block reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "vpage/kernels/kernel_args.h"

namespace vpage::cuda::detail {

inline constexpr int kWarpSize = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;

/// Elements of T in one 16-byte fragment (the `x` of the key cache layout).
template <typename T>
inline constexpr int kPack = 16 / static_cast<int>(sizeof(T));

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

/// The 16 bytes `raw` (one fragment of T) widened to float.
template <typename T>
__device__ __forceinline__ void widen(const uint4& raw, float (&out)[kPack<T>]) {
  const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kPack<T>; ++i) out[i] = to_float(elems[i]);
}

/// Loads 16 bytes at `ptr` (16-byte aligned) and widens them to float.
template <typename T>
__device__ __forceinline__ void load_pack(const T* ptr, float (&out)[kPack<T>]) {
  widen<T>(*reinterpret_cast<const uint4*>(ptr), out);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, mask));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) v += __shfl_xor_sync(kFullMask, v, mask);
  return v;
}

/// Max over the thread block; `scratch` holds kNumWarps floats. Every thread gets the result.
template <int kNumWarps>
__device__ __forceinline__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kNumWarps; ++w) r = fmaxf(r, scratch[w]);
  __syncthreads();
  return r;
}

/// Sum over the thread block; `scratch` holds kNumWarps floats. Every thread gets the result.
template <int kNumWarps>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float r = 0.0f;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) r += scratch[w];
  __syncthreads();
  return r;
}

}  // namespace vpage::cuda::detail
