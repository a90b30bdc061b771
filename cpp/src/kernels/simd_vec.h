// A minimal fp32 vector type for the attention kernel, one implementation per instruction
// set, chosen by the compiler's target macros: AVX-512 (16 lanes), AVX2+FMA+F16C (8 lanes)
// or portable C++ (8 lanes, left to the auto-vectoriser: SSE2 on x86-64, NEON on aarch64).
// Everything lives in namespace VPAGE_ISA_NAMESPACE, so builds with different flags
// never share an inline function (no ODR mix-up of AVX-512 code into the generic path).
// 16-bit storage types are loaded/stored with conversion to/from fp32.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define VPAGE_SIMD_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VPAGE_SIMD_AVX2 1
#include <immintrin.h>
#else
#include <math.h>

#include "vpage/kernels/half.h"
#endif

#ifndef VPAGE_ISA_NAMESPACE
#error "define VPAGE_ISA_NAMESPACE before including simd_vec.h"
#endif

// For small helpers called inside a micro-kernel's loop: left out of line (GCC's inliner may,
// in a big enough caller), every call spills the accumulators (the bf16 dot-product matmul
// ran 2.5x slower at 8-16 rows so).
#define VPAGE_ALWAYS_INLINE inline __attribute__((always_inline))

namespace vpage::cpu::VPAGE_ISA_NAMESPACE {

/// float16 storage (IEEE binary16 bits).
struct F16 {
  uint16_t bits;
};
/// bfloat16 storage.
struct BF16 {
  uint16_t bits;
};

// exp(x) for x <= 0 (softmax after subtracting the max): exp(x) = 2^n * e^r with
// n = round(x / ln 2), |r| <= ln2 / 2, e^r by a degree-6 polynomial; x < -87 gives 0.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpUnderflow = -87.0f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(VPAGE_SIMD_AVX512)

constexpr int kLanes = 16;
struct Vec {
  __m512 v;
};
inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec set1(float a) { return {_mm512_set1_ps(a)}; }
inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec load(const F16* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline Vec load(const BF16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline void store(F16* p, Vec a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store(BF16* p, Vec a) {
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  rounded = _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
inline Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec div(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec abs(Vec a) { return {_mm512_abs_ps(a.v)}; }
// |magnitude| with the sign bit of `sign`.
inline Vec copy_sign(Vec magnitude, Vec sign) {
  const __m512 bit = _mm512_set1_ps(-0.0f);
  return {_mm512_or_ps(_mm512_andnot_ps(bit, magnitude.v), _mm512_and_ps(bit, sign.v))};
}
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }
// Sums of adjacent lane pairs of the concatenation [a, b]: {a0+a1, a2+a3, ..., b14+b15}.
inline Vec pair_sum(Vec a, Vec b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return {_mm512_add_ps(_mm512_permutex2var_ps(a.v, even, b.v), _mm512_permutex2var_ps(a.v, odd, b.v))};
}
inline Vec exp_nonpositive(Vec x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x.v, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x.v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __mmask16 keep = _mm512_cmp_ps_mask(x.v, _mm512_set1_ps(kExpUnderflow), _CMP_GE_OQ);
  return {_mm512_maskz_scalef_ps(keep, p, n)};
}

#elif defined(VPAGE_SIMD_AVX2)

constexpr int kLanes = 8;
struct Vec {
  __m256 v;
};
inline Vec zero() { return {_mm256_setzero_ps()}; }
inline Vec set1(float a) { return {_mm256_set1_ps(a)}; }
inline Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Vec load(const F16* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline Vec load(const BF16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16))};
}
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
inline void store(F16* p, Vec a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store(BF16* p, Vec a) {
  const __m256i bits = _mm256_castps_si256(a.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
  rounded = _mm256_blendv_epi8(rounded, quiet, nan);
  const __m256i high = _mm256_srli_epi32(rounded, 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec div(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec abs(Vec a) { return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)}; }
// |magnitude| with the sign bit of `sign`.
inline Vec copy_sign(Vec magnitude, Vec sign) {
  const __m256 bit = _mm256_set1_ps(-0.0f);
  return {_mm256_or_ps(_mm256_andnot_ps(bit, magnitude.v), _mm256_and_ps(bit, sign.v))};
}
inline float reduce_add(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_max(Vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// Sums of adjacent lane pairs of the concatenation [a, b]: {a0+a1, a2+a3, ..., b6+b7}.
// hadd gives {a01, a23, b01, b23 | a45, a67, b45, b67}; the 64-bit permute restores order.
inline Vec pair_sum(Vec a, Vec b) {
  const __m256 h = _mm256_hadd_ps(a.v, b.v);
  return {_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), _MM_SHUFFLE(3, 1, 2, 0)))};
}
inline Vec exp_nonpositive(Vec x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x.v, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x.v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  p = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
  const __m256 keep = _mm256_cmp_ps(x.v, _mm256_set1_ps(kExpUnderflow), _CMP_GE_OQ);
  return {_mm256_and_ps(p, keep)};
}

#else

constexpr int kLanes = 8;
struct Vec {
  float v[kLanes];
};
inline Vec zero() { return Vec{}; }
inline Vec set1(float a) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = a;
  return r;
}
inline Vec load(const float* p) {
  Vec r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline Vec load(const F16* p) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = half_to_float(p[i].bits);
  return r;
}
inline Vec load(const BF16* p) {
  Vec r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = bfloat16_to_float(p[i].bits);
  return r;
}
inline void store(float* p, Vec a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline void store(F16* p, Vec a) {
  for (int i = 0; i < kLanes; ++i) p[i].bits = float_to_half(a.v[i]);
}
inline void store(BF16* p, Vec a) {
  for (int i = 0; i < kLanes; ++i) p[i].bits = float_to_bfloat16(a.v[i]);
}
inline Vec add(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline Vec mul(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] *= b.v[i];
  return a;
}
inline Vec max(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
  return a;
}
inline Vec fma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < kLanes; ++i) c.v[i] += a.v[i] * b.v[i];
  return c;
}
inline Vec div(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] /= b.v[i];
  return a;
}
inline Vec abs(Vec a) {
  for (int i = 0; i < kLanes; ++i) a.v[i] = fabsf(a.v[i]);
  return a;
}
// |magnitude| with the sign bit of `sign`.
inline Vec copy_sign(Vec magnitude, Vec sign) {
  for (int i = 0; i < kLanes; ++i) magnitude.v[i] = copysignf(magnitude.v[i], sign.v[i]);
  return magnitude;
}
inline float reduce_add(Vec a) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += a.v[i];
  return s;
}
inline float reduce_max(Vec a) {
  float m = a.v[0];
  for (int i = 1; i < kLanes; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
// Sums of adjacent lane pairs of the concatenation [a, b].
inline Vec pair_sum(Vec a, Vec b) {
  Vec r;
  for (int i = 0; i < kLanes / 2; ++i) {
    r.v[i] = a.v[2 * i] + a.v[2 * i + 1];
    r.v[kLanes / 2 + i] = b.v[2 * i] + b.v[2 * i + 1];
  }
  return r;
}
inline Vec exp_nonpositive(Vec x) {
  for (int i = 0; i < kLanes; ++i) x.v[i] = x.v[i] < kExpUnderflow ? 0.0f : expf(x.v[i]);
  return x;
}

#endif

/// cap * tanh(x / cap) (attention logit soft-capping, cap > 0), by exp_nonpositive:
/// tanh(|y|) = (1 - e) / (1 + e) with e = exp(-2 |y|), then the sign of x. Absolute error
/// about cap * 1e-7; -inf maps to -cap, so masks go on after the cap.
inline Vec soft_cap(Vec x, float cap) {
  const Vec e = exp_nonpositive(mul(abs(x), set1(-2.0f / cap)));
  const Vec one = set1(1.0f);
  const Vec t = div(add(one, mul(e, set1(-1.0f))), add(one, e));
  return mul(copy_sign(t, x), set1(cap));
}

/// Lane i = p[i * stride] (fp32; a strided column, e.g. for transposes).
inline Vec load_strided(const float* p, int stride) {
#if defined(VPAGE_SIMD_AVX512)
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(stride));
  return {_mm512_i32gather_ps(idx, p, 4)};
#elif defined(VPAGE_SIMD_AVX2)
  const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(stride));
  return {_mm256_i32gather_ps(p, idx, 4)};
#else
  float tmp[kLanes];
  for (int i = 0; i < kLanes; ++i) tmp[i] = p[static_cast<int64_t>(i) * stride];
  return load(tmp);
#endif
}

/// Lanes [0, n) of a, the other lanes zero (0 <= n <= kLanes; NaN past n also becomes 0).
inline Vec keep_first(Vec a, int n) {
#if defined(VPAGE_SIMD_AVX512)
  return {_mm512_maskz_mov_ps(static_cast<__mmask16>((1u << n) - 1u), a.v)};
#elif defined(VPAGE_SIMD_AVX2)
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return {_mm256_and_ps(a.v, _mm256_castsi256_ps(keep))};
#else
  for (int i = n; i < kLanes; ++i) a.v[i] = 0.0f;
  return a;
#endif
}

/// Loads the first n (< kLanes) elements, the other lanes are zero.
template <typename T>
inline Vec load_partial(const T* p, int n) {
  T tmp[kLanes];
  std::memset(tmp, 0, sizeof(tmp));
  std::memcpy(tmp, p, sizeof(T) * n);
  return load(tmp);
}

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE
