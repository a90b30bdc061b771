// Rotary position embedding (rotate-half / NeoX convention) applied in place, on the CPU.
#pragma once

#include <cstdint>

#include "vpage/common.h"
#include "vpage/kernels/kernel_args.h"

namespace vpage {

/// Rotates the first `num_heads` heads of every row of `x` in place. For a head `h` of a
/// token at position p, with c = cos_sin[p, :head_size/2] and s = cos_sin[p, head_size/2:]:
///   h[:half], h[half:] = h[:half] * c - h[half:] * s, h[half:] * c + h[:half] * s
/// (transformers' `x * cos + rotate_half(x) * sin`). Query and key heads that sit side by side
/// in a fused QKV row are rotated in one call.
struct RotaryArgs {
  void* x = nullptr;                 // [num_tokens, row_stride] rows, heads contiguous from column 0
  int64_t row_stride = 0;            // elements between consecutive tokens of `x`
  const int64_t* positions = nullptr;  // [num_tokens], each in [0, max_position)
  const float* cos_sin = nullptr;    // [max_position, head_size] float32: cos half, then sin half
  int64_t max_position = 0;
  int64_t num_tokens = 0;
  int32_t num_heads = 0;
  int32_t head_size = 0;             // even
  DType dtype = DType::kFloat32;     // of `x`; the rotation is computed in float32
};

namespace cpu {

/// Multi-threaded over token ranges. Throws vpage::CheckError on bad sizes or positions.
void rotary_embedding(const RotaryArgs& args, int num_threads);

}  // namespace cpu
}  // namespace vpage
