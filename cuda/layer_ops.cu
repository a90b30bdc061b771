// Per-row layer ops (vpage/cuda/layer_ops.h).
//
// Grid and threads: one thread block per row (rms_norm; rms_norm_heads: per (token, head);
// rotary_embedding and silu_and_mul: per token), rows spread over grid x (at most 65535)
// and y. Threads stride over the row's values; the norms sum squares in
// float32 and meet in a block reduction. Loads and stores are element-wise: these kernels
// are small next to a layer's matmuls, and their count, not their bandwidth, is what they fix.
#include "vpage/cuda/layer_ops.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "dtype_utils.cuh"

namespace vpage::cuda {
namespace {

using detail::block_sum;
using detail::from_float;
using detail::kWarpSize;
using detail::to_float;

constexpr int kThreads = 256;
constexpr int kNumWarps = kThreads / kWarpSize;
constexpr int64_t kMaxGridX = 65535;

/// The grid covering `rows` thread blocks, and the row of this block.
dim3 row_grid(int64_t rows) {
  const int64_t y = (rows + kMaxGridX - 1) / kMaxGridX;
  return dim3(static_cast<unsigned>(rows < kMaxGridX ? rows : kMaxGridX), static_cast<unsigned>(y));
}
__device__ __forceinline__ int64_t block_row() { return int64_t{blockIdx.y} * gridDim.x + blockIdx.x; }

/// x rounded to T and back: torch rounds each op's result to the tensor dtype.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

// rms_norm over one row of `cols` values at `x` -> `out` (may alias x); residual: see header.
template <typename T>
__device__ __forceinline__ void norm_row(T* out, T* x, T* residual, const T* weight, int32_t cols, float epsilon) {
  __shared__ float scratch[kNumWarps];
  float sum = 0.0f;
  for (int32_t i = threadIdx.x; i < cols; i += kThreads) {
    float v = to_float(x[i]);
    if (residual != nullptr) {
      v = round_to<T>(__fadd_rn(to_float(residual[i]), v));
      residual[i] = from_float<T>(v);  // read back below by this thread only
    }
    sum = fmaf(v, v, sum);
  }
  const float inv = rsqrtf(block_sum<kNumWarps>(sum, scratch) / static_cast<float>(cols) + epsilon);
  const T* src = residual != nullptr ? residual : x;
  for (int32_t i = threadIdx.x; i < cols; i += kThreads) {
    const float normed = round_to<T>(__fmul_rn(to_float(src[i]), inv));
    out[i] = from_float<T>(__fmul_rn(normed, to_float(weight[i])));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(T* out, int64_t out_stride, T* input, int64_t input_stride,
                                                            T* residual, const T* weight, int64_t rows, int32_t cols,
                                                            float epsilon) {
  const int64_t row = block_row();
  if (row >= rows) return;
  norm_row(out + row * out_stride, input + row * input_stride, residual == nullptr ? nullptr : residual + row * cols,
           weight, cols, epsilon);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rms_norm_heads_kernel(T* x, int64_t rows, int64_t row_stride,
                                                                  int32_t num_heads, int32_t head_size,
                                                                  const T* weight, float epsilon) {
  const int64_t row = block_row();
  if (row >= rows) return;
  T* head = x + (row / num_heads) * row_stride + (row % num_heads) * head_size;
  norm_row<T>(head, head, nullptr, weight, head_size, epsilon);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rotary_kernel(T* x, int64_t tokens, int64_t row_stride,
                                                          const int64_t* positions, const float* cos_sin,
                                                          int32_t num_heads, int32_t head_size, int32_t rotary_dim) {
  const int64_t token = block_row();
  if (token >= tokens) return;
  const int32_t half = rotary_dim / 2;
  const float* table = cos_sin + positions[token] * rotary_dim;
  T* row = x + token * row_stride;
  for (int32_t p = threadIdx.x; p < num_heads * half; p += kThreads) {
    const int32_t i = p % half;
    T* head = row + (p / half) * head_size;
    const float c = table[i], s = table[half + i];
    const float x1 = to_float(head[i]), x2 = to_float(head[i + half]);
    head[i] = from_float<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    head[i + half] = from_float<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) silu_and_mul_kernel(T* out, int64_t out_stride, const T* input,
                                                                int64_t input_stride, int64_t tokens, int32_t d) {
  const int64_t token = block_row();
  if (token >= tokens) return;
  const T* gate = input + token * input_stride;
  T* dst = out + token * out_stride;
  for (int32_t i = threadIdx.x; i < d; i += kThreads) {
    const float g = to_float(gate[i]);
    const float silu = round_to<T>(g / (1.0f + expf(-g)));
    dst[i] = from_float<T>(__fmul_rn(silu, to_float(gate[d + i])));
  }
}

/// Runs launch.template operator()<T>() for the element type of `dtype`.
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

cudaError_t rms_norm(void* out, int64_t out_stride, void* input, int64_t input_stride, void* residual,
                     const void* weight, int64_t rows, int32_t cols, float epsilon, DType dtype,
                     cudaStream_t stream) {
  if (rows < 0 || cols <= 0 || !(epsilon >= 0.0f) || (residual != nullptr && out != input)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return for_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    rms_norm_kernel<T><<<row_grid(rows), kThreads, 0, stream>>>(
        static_cast<T*>(out), out_stride, static_cast<T*>(input), input_stride, static_cast<T*>(residual),
        static_cast<const T*>(weight), rows, cols, epsilon);
    return cudaGetLastError();
  });
}

cudaError_t rms_norm_heads(void* x, int64_t tokens, int64_t row_stride, int32_t num_heads, int32_t head_size,
                           const void* weight, float epsilon, DType dtype, cudaStream_t stream) {
  if (tokens < 0 || num_heads < 0 || head_size <= 0 || !(epsilon >= 0.0f)) return cudaErrorInvalidValue;
  if (tokens == 0 || num_heads == 0) return cudaSuccess;
  const int64_t rows = tokens * num_heads;
  return for_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    rms_norm_heads_kernel<T><<<row_grid(rows), kThreads, 0, stream>>>(
        static_cast<T*>(x), rows, row_stride, num_heads, head_size, static_cast<const T*>(weight), epsilon);
    return cudaGetLastError();
  });
}

cudaError_t rotary_embedding(void* x, int64_t tokens, int64_t row_stride, const int64_t* positions,
                             const float* cos_sin, int32_t num_heads, int32_t head_size, int32_t rotary_dim,
                             DType dtype, cudaStream_t stream) {
  if (tokens < 0 || num_heads < 0 || rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > head_size) {
    return cudaErrorInvalidValue;
  }
  if (tokens == 0 || num_heads == 0) return cudaSuccess;
  return for_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    rotary_kernel<T><<<row_grid(tokens), kThreads, 0, stream>>>(static_cast<T*>(x), tokens, row_stride, positions,
                                                                 cos_sin, num_heads, head_size, rotary_dim);
    return cudaGetLastError();
  });
}

cudaError_t silu_and_mul(void* out, int64_t out_stride, const void* input, int64_t input_stride, int64_t tokens,
                         int32_t d, DType dtype, cudaStream_t stream) {
  if (tokens < 0 || d <= 0) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  return for_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    silu_and_mul_kernel<T><<<row_grid(tokens), kThreads, 0, stream>>>(
        static_cast<T*>(out), out_stride, static_cast<const T*>(input), input_stride, tokens, d);
    return cudaGetLastError();
  });
}

}  // namespace vpage::cuda
