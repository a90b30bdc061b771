// Per-row layer ops on the GPU: RMS norm (of rows, with an optional fused residual add, and of
// heads), rotary embedding and SiLU-and-mul. One launch each, so a decode layer is a handful
// of kernels instead of the dozens torch's composite ops take. Each reproduces the roundings
// of the torch composite it replaces (vpage/ops/layer.py): float32 arithmetic, results
// rounded to the dtype where torch rounds them. All pointers are device pointers; dtype is
// that of every activation and weight (the rotary table is float32).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "vpage/kernels/kernel_args.h"

namespace vpage::cuda {

/// Rows [rows, cols] of `input` (row stride input_stride) -> `out` (out_stride; may be
/// input): out = dtype(dtype(x * rsqrt(mean(x^2) + eps)) * weight), statistics in float32.
/// With `residual` (contiguous [rows, cols], non-null): first residual = dtype(residual +
/// input), then `input` gets the norm of the new residual (out must be input).
cudaError_t rms_norm(void* out, int64_t out_stride, void* input, int64_t input_stride, void* residual,
                     const void* weight, int64_t rows, int32_t cols, float epsilon, DType dtype,
                     cudaStream_t stream);

/// In place, each of the first num_heads heads (head_size values) of every row of x
/// [tokens, row_stride] becomes rms_norm(head) * weight [head_size], as rms_norm rounds.
cudaError_t rms_norm_heads(void* x, int64_t tokens, int64_t row_stride, int32_t num_heads, int32_t head_size,
                           const void* weight, float epsilon, DType dtype, cudaStream_t stream);

/// In place, the first rotary_dim values of each of the first num_heads heads of every row of
/// x [tokens, row_stride], rotate-half: with c, s = cos_sin[positions[t]][i], [.. + half]
/// (float32 [max_position, rotary_dim]), x1, x2 = head[i], head[i + half] as float:
/// head[i] = x1 c - x2 s, head[i + half] = x2 c + x1 s (each product rounded, as torch does).
cudaError_t rotary_embedding(void* x, int64_t tokens, int64_t row_stride, const int64_t* positions,
                             const float* cos_sin, int32_t num_heads, int32_t head_size, int32_t rotary_dim,
                             DType dtype, cudaStream_t stream);

/// out [tokens, d] (row stride out_stride) = dtype(silu(gate)) * up, with gate, up the halves
/// of input [tokens, 2 d] (row stride input_stride); silu in float32, rounded to the dtype
/// before the product, as torch's F.silu(gate) * up.
cudaError_t silu_and_mul(void* out, int64_t out_stride, const void* input, int64_t input_stride, int64_t tokens,
                         int32_t d, DType dtype, cudaStream_t stream);

}  // namespace vpage::cuda
