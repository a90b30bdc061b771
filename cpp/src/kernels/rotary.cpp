// Threads take ranges of tokens; each token's heads (their first rotary_dim elements) are
// rotated with the position's cos/sin row. The float32 loop is compiled for AVX-512, AVX2 and
// baseline (chosen at load time) and keeps the two roundings of `a * c - b * s` (no FMA
// contraction), so results equal torch's.
#include "vpage/kernels/rotary.h"

#include <algorithm>

#include "target_clones.h"
#include "thread_pool.h"
#include "vpage/common.h"
#include "vpage/kernels/half.h"

namespace vpage::cpu {
namespace {

constexpr int64_t kTokensPerTask = 32;

VPAGE_TARGET_CLONES
void rotate_f32(float* row, const float* cos, const float* sin, int32_t num_heads, int32_t head_size,
                int32_t half) {
  for (int32_t h = 0; h < num_heads; ++h) {
    float* a = row + static_cast<int64_t>(h) * head_size;
    float* b = a + half;
    for (int32_t i = 0; i < half; ++i) {
      const float x1 = a[i], x2 = b[i];
      a[i] = x1 * cos[i] - x2 * sin[i];
      b[i] = x2 * cos[i] + x1 * sin[i];
    }
  }
}

// Cloned too: bfloat16's branch-free conversions vectorise (float16's do not).
template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
VPAGE_TARGET_CLONES void rotate_16(uint16_t* row, const float* cos, const float* sin, int32_t num_heads, int32_t head_size,
               int32_t half) {
  for (int32_t h = 0; h < num_heads; ++h) {
    uint16_t* a = row + static_cast<int64_t>(h) * head_size;
    uint16_t* b = a + half;
    for (int32_t i = 0; i < half; ++i) {
      const float x1 = ToFloat(a[i]), x2 = ToFloat(b[i]);
      a[i] = FromFloat(x1 * cos[i] - x2 * sin[i]);
      b[i] = FromFloat(x2 * cos[i] + x1 * sin[i]);
    }
  }
}

}  // namespace

void rotary_embedding(const RotaryArgs& args, int num_threads) {
  const int32_t rotary_dim = args.rotary_dim == 0 ? args.head_size : args.rotary_dim;
  VPAGE_CHECK(args.head_size > 0 && rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= args.head_size &&
                  args.num_heads >= 0 && args.num_tokens >= 0 &&
                  args.row_stride >= static_cast<int64_t>(args.num_heads) * args.head_size,
              "rotary_embedding: bad sizes (head_size " << args.head_size << ", rotary_dim " << args.rotary_dim
                                                        << ", num_heads " << args.num_heads << ", row_stride "
                                                        << args.row_stride << ")");
  for (int64_t t = 0; t < args.num_tokens; ++t) {
    VPAGE_CHECK(args.positions[t] >= 0 && args.positions[t] < args.max_position,
                "rotary_embedding: position " << args.positions[t] << " outside [0, " << args.max_position << ")");
  }
  const int64_t num_tasks = (args.num_tokens + kTokensPerTask - 1) / kTokensPerTask;
  const int32_t half = rotary_dim / 2;
  const int elem = dtype_size(args.dtype);
  ThreadPool::instance().parallel_for(num_tasks, std::max(num_threads, 1), [&](int64_t task, int) {
    const int64_t end = std::min(args.num_tokens, (task + 1) * kTokensPerTask);
    for (int64_t t = task * kTokensPerTask; t < end; ++t) {
      const float* cos = args.cos_sin + args.positions[t] * rotary_dim;
      const float* sin = cos + half;
      char* row = static_cast<char*>(args.x) + t * args.row_stride * elem;
      switch (args.dtype) {
        case DType::kFloat32:
          rotate_f32(reinterpret_cast<float*>(row), cos, sin, args.num_heads, args.head_size, half);
          break;
        case DType::kFloat16:
          rotate_16<half_to_float, float_to_half>(reinterpret_cast<uint16_t*>(row), cos, sin, args.num_heads,
                                                  args.head_size, half);
          break;
        case DType::kBFloat16:
          rotate_16<bfloat16_to_float, float_to_bfloat16>(reinterpret_cast<uint16_t*>(row), cos, sin,
                                                          args.num_heads, args.head_size, half);
          break;
      }
    }
  });
}

}  // namespace vpage::cpu
