// Row-wise operations of a decoder layer on the CPU, fused so each row is read and written
// once: RMSNorm with the residual add in front of it, and the gated MLP's SiLU-and-multiply.
// Rows are contiguous; the arithmetic is float32 with the same roundings as the unfused
// torch operations the model code would otherwise run (see each function).
#pragma once

#include <cstdint>

#include "vpage/common.h"
#include "vpage/kernels/kernel_args.h"

namespace vpage {

/// out = rms_norm(src) * weight per row, src = x, or, with a residual, residual += x first
/// and src = the new residual. `out` may be `x`.
struct RmsNormArgs {
  void* out = nullptr;           // [num_tokens, hidden_size]
  const void* x = nullptr;       // [num_tokens, hidden_size]
  void* residual = nullptr;      // nullptr, or [num_tokens, hidden_size], updated in place
  const void* weight = nullptr;  // [hidden_size]
  int64_t num_tokens = 0;
  int32_t hidden_size = 0;
  float eps = 1e-6f;
  DType dtype = DType::kFloat32;  // of every tensor
};

/// out[t, i] = silu(x[t, i]) * x[t, d + i] for i < d, with x [num_tokens, 2 d] (gate then up
/// halves of a fused projection) and out [num_tokens, d].
struct SiluAndMulArgs {
  void* out = nullptr;
  const void* x = nullptr;
  int64_t num_tokens = 0;
  int32_t d = 0;
  DType dtype = DType::kFloat32;
};

namespace cpu {

/// Per row: (residual = dtype(residual + x);) inv = 1 / sqrt(mean(src^2) + eps) in float32;
/// out = dtype(dtype(src * inv) * weight). Multi-threaded over token ranges.
/// Throws vpage::CheckError on bad sizes.
void rms_norm(const RmsNormArgs& args, int num_threads);

/// s = dtype(a / (1 + exp(-a))), out = dtype(s * b) (torch's silu then mul); exp by a
/// polynomial within ~1 ulp of expf. Multi-threaded over token ranges.
/// Throws vpage::CheckError on bad sizes.
void silu_and_mul(const SiluAndMulArgs& args, int num_threads);

}  // namespace cpu
}  // namespace vpage
