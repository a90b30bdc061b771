// Row-wise operations of a decoder layer on the CPU, fused so each row is read and written
// once: RMSNorm with the residual add in front of it, RMSNorm of each attention head (q/k
// norms), and the gated MLP's SiLU- or GELU(tanh)-and-multiply.
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

/// out[t, i] = gelu_tanh(x[t, i]) * x[t, d + i]: the layout of SiluAndMulArgs.
using GeluTanhAndMulArgs = SiluAndMulArgs;

/// out[t, i] = out[t, i] + sigmoid(gate[t]) * y[t, i]: a gated branch joining a sum (Qwen2-MoE's
/// shared expert joining the experts' output).
struct SigmoidGatedAddArgs {
  void* out = nullptr;         // [num_tokens, d], updated in place
  const void* y = nullptr;     // [num_tokens, d]
  const void* gate = nullptr;  // [num_tokens]: the sigmoid's argument per row
  int64_t num_tokens = 0;
  int32_t d = 0;
  DType dtype = DType::kFloat32;  // of out, y and gate
};

/// In place, each of the first `num_heads` heads h of every row of `x` becomes
/// rms_norm(h) * weight (per-head q/k norms); the rest of each row is untouched.
struct RmsNormHeadsArgs {
  void* x = nullptr;             // [num_tokens, row_stride] rows, heads contiguous from column 0
  int64_t row_stride = 0;        // elements between consecutive tokens of `x`
  const void* weight = nullptr;  // [head_size]
  int64_t num_tokens = 0;
  int32_t num_heads = 0;
  int32_t head_size = 0;
  float eps = 1e-6f;
  DType dtype = DType::kFloat32;  // of `x` and `weight`
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

/// g = dtype(gelu_tanh(a)), out = dtype(g * b) (torch's F.gelu(approximate="tanh") then mul).
/// gelu_tanh(a) = 0.5 a (1 + tanh(z / 2)) is computed as a / (1 + exp(-z)), z = 2 sqrt(2/pi)
/// (a + 0.044715 a^3), with exp_clamped: float32 within (2 + |z|) 1.6e-7 relative of the exact
/// function (z's own float32 rounding, magnified by exp; torch's `1 + tanh` loses more for
/// a < -2, where it cancels; for z < -88, a below about -10, the result is a / exp(88), below 1e-37,
/// instead of ~0).
/// Multi-threaded over token ranges. Throws vpage::CheckError on bad sizes.
void gelu_tanh_and_mul(const GeluTanhAndMulArgs& args, int num_threads);

/// s = 1 / (1 + exp(-gate)) in float32 (std::exp), out = dtype(out + s * y) with float32
/// arithmetic and one rounding. Multi-threaded over token ranges.
/// Throws vpage::CheckError on bad sizes.
void sigmoid_gated_add(const SigmoidGatedAddArgs& args, int num_threads);

/// Per head, exactly rms_norm's arithmetic on the head as a row (no residual).
/// Multi-threaded over token ranges. Throws vpage::CheckError on bad sizes.
void rms_norm_heads(const RmsNormHeadsArgs& args, int num_threads);

}  // namespace cpu
}  // namespace vpage
