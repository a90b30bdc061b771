#include "float_rows.h"

#include <cstring>

#include "target_clones.h"
#include "thread_pool.h"
#include "vpage/kernels/half.h"

namespace vpage::cpu {
namespace {

// Plain loops the compiler vectorises in each target clone.
VPAGE_TARGET_CLONES void widen_bfloat16(const uint16_t* src, float* dst, int32_t n) {
  for (int32_t i = 0; i < n; ++i) dst[i] = bfloat16_to_float(src[i]);
}

VPAGE_TARGET_CLONES void round_to_bfloat16(const float* values, uint16_t* dst, int32_t n) {
  for (int32_t i = 0; i < n; ++i) dst[i] = float_to_bfloat16(values[i]);
}

VPAGE_TARGET_CLONES void round_to_bfloat16_with_bias(const float* values, const float* bias, uint16_t* dst,
                                                     int32_t n) {
  for (int32_t i = 0; i < n; ++i) dst[i] = float_to_bfloat16(values[i] + bias[i]);
}

}  // namespace

const float* float32_rows(DType dtype, const void* x, int64_t m, int32_t k, int64_t x_stride,
                          std::vector<float>& buffer, int64_t* stride, int num_threads) {
  if (dtype == DType::kFloat32) {
    *stride = x_stride;
    return static_cast<const float*>(x);
  }
  buffer.resize(static_cast<size_t>(m) * k);
  *stride = k;
  const uint16_t* src_rows = static_cast<const uint16_t*>(x);
  float* dst_rows = buffer.data();
  ThreadPool::instance().parallel_for(m, num_threads, [&](int64_t row, int) {
    load_float32_row(dtype, src_rows + row * x_stride, dst_rows + row * k, k);
  });
  return dst_rows;
}

void load_float32_row(DType dtype, const void* x, float* out, int32_t n) {
  if (dtype == DType::kFloat32) {
    std::memcpy(out, x, sizeof(float) * n);
  } else if (dtype == DType::kBFloat16) {
    widen_bfloat16(static_cast<const uint16_t*>(x), out, n);
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(x);
    for (int32_t i = 0; i < n; ++i) out[i] = half_to_float(src[i]);
  }
}

void store_float32_row(DType dtype, void* out, const float* values, const float* bias, int32_t n) {
  if (dtype == DType::kFloat32) {
    float* dst = static_cast<float*>(out);
    if (bias == nullptr) {
      std::memcpy(dst, values, sizeof(float) * n);
    } else {
      for (int32_t j = 0; j < n; ++j) dst[j] = values[j] + bias[j];
    }
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(out);
  if (dtype == DType::kBFloat16) {
    if (bias == nullptr) {
      round_to_bfloat16(values, dst, n);
    } else {
      round_to_bfloat16_with_bias(values, bias, dst, n);
    }
    return;
  }
  for (int32_t j = 0; j < n; ++j) {
    const float v = bias == nullptr ? values[j] : values[j] + bias[j];
    dst[j] = float_to_half(v);
  }
}

}  // namespace vpage::cpu
