// exp(x) by a branch-free polynomial, shared by the row kernels (layer_ops.cpp, sampler_ops.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace vpage::cpu {

// exp(x) clamped to [-87, 88] (normal results): 2^n * e^r with n = round(x / ln 2) by the
// 1.5 * 2^23 trick, r = x - n ln 2 in two parts, e^r by Cephes' degree-6 polynomial (~1 ulp).
// Branch-free, so the loops calling it vectorise.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + (r + 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace vpage::cpu
