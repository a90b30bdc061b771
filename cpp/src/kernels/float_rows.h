// Activation rows as float32 for the matmul kernels, and float32 results back to the
// activation dtype: shared by quant_matmul and dense_matmul (baseline flags).
#pragma once

#include <cstdint>
#include <vector>

#include "vpage/kernels/kernel_args.h"

namespace vpage::cpu {

/// x [m, k] (row stride x_stride, dtype `dtype`) as float32 rows: x itself for float32
/// (*stride = x_stride), else a converted copy in `buffer` (*stride = k), threads over rows.
const float* float32_rows(DType dtype, const void* x, int64_t m, int32_t k, int64_t x_stride,
                          std::vector<float>& buffer, int64_t* stride, int num_threads);

/// out[0 : n] = the n values at `x` (dtype `dtype`) as float32.
void load_float32_row(DType dtype, const void* x, float* out, int32_t n);

/// out[0 : n] = values (+ bias, when not null) converted to `dtype` (bfloat16/float16 round to
/// nearest even).
void store_float32_row(DType dtype, void* out, const float* values, const float* bias, int32_t n);

}  // namespace vpage::cpu
