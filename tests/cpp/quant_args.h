// QuantMatmulArgs for the quantized matmul tests: contiguous rows, float32 activations.
#pragma once

#include <cstdint>

#include "vpage/kernels/quant_matmul.h"

namespace vpage_test {

/// out [m, n] = x [m, k] @ w^T, rows contiguous.
inline vpage::QuantMatmulArgs matmul_args(vpage::QuantType type, const uint8_t* w, const float* x, float* out,
                                          int64_t m, int n, int k) {
  vpage::QuantMatmulArgs a;
  a.out = out;
  a.x = x;
  a.weight = w;
  a.m = m;
  a.n = n;
  a.k = k;
  a.x_stride = k;
  a.out_stride = n;
  a.type = type;
  return a;
}

}  // namespace vpage_test
