// Rotary position embedding (rotate-half / NeoX convention) applied in place, on the CPU.
#pragma once

#include <cstdint>

#include "vpage/common.h"
#include "vpage/kernels/kernel_args.h"

namespace vpage {

/// Rotates the first `rotary_dim` elements of each of the first `num_heads` heads of every row
/// of `x` in place. For a head `h` of a token at position p, with r = h[:rotary_dim],
/// half = rotary_dim / 2, c = cos_sin[p, :half] and s = cos_sin[p, half:]:
///   r[:half], r[half:] = r[:half] * c - r[half:] * s, r[half:] * c + r[:half] * s
/// (transformers' `x * cos + rotate_half(x) * sin`, over the partial_rotary_factor's part of
/// the head); h[rotary_dim:] is untouched. Query and key heads that sit side by side in a fused
/// QKV row are rotated in one call.
struct RotaryArgs {
  void* x = nullptr;                 // [num_tokens, row_stride] rows, heads contiguous from column 0
  int64_t row_stride = 0;            // elements between consecutive tokens of `x`
  const int64_t* positions = nullptr;  // [num_tokens], each in [0, max_position)
  const float* cos_sin = nullptr;    // [max_position, rotary_dim] float32: cos half, then sin half
  int64_t max_position = 0;
  int64_t num_tokens = 0;
  int32_t num_heads = 0;
  int32_t head_size = 0;
  int32_t rotary_dim = 0;            // even, in (0, head_size]; 0 means head_size
  DType dtype = DType::kFloat32;     // of `x`; the rotation is computed in float32
};

namespace cpu {

/// Multi-threaded over token ranges. Throws vpage::CheckError on bad sizes or positions.
void rotary_embedding(const RotaryArgs& args, int num_threads);

}  // namespace cpu
}  // namespace vpage
