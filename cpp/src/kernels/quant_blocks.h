// Dequantization of ggml blocks (layouts in vpage/kernels/quant_matmul.h) into float32, one
// function per format. Plain loops of fixed length that the compiler vectorises with the
// flags of the ISA build including this file (everything lives in VPAGE_ISA_NAMESPACE, like
// simd_vec.h, so no inline function is shared between builds with different flags).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#if !defined(__F16C__)
#include "vpage/kernels/half.h"
#endif
#include "vpage/kernels/quant_matmul.h"

#ifndef VPAGE_ISA_NAMESPACE
#error "define VPAGE_ISA_NAMESPACE before including quant_blocks.h"
#endif

namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm {  // qmm: no name clash with attention_impl.h's

/// The little-endian IEEE half at `p` as a float.
inline float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return vpage::half_to_float(h);
#endif
}

// 32-value blocks: dst[32] = scale * q + offset. The x86 builds unpack with intrinsics (the
// compiler does not vectorise the nibble split well); the portable build uses plain loops.
#if defined(__AVX512F__) && defined(__AVX512BW__)
// q: 16 unsigned bytes (values of one half of a 4-bit block) -> dst[16].
inline void store_u8x16(__m128i q, __m512 scale, __m512 offset, float* dst) {
  _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), scale, offset));
}
inline void store_i8x16(__m128i q, __m512 scale, float* dst) {
  _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), scale));
}
inline void dequant_nibbles(const uint8_t* qs, float scale, float offset, float* dst) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(15);
  const __m512 vs = _mm512_set1_ps(scale), vo = _mm512_set1_ps(offset);
  store_u8x16(_mm_and_si128(raw, mask), vs, vo, dst);
  store_u8x16(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), vs, vo, dst + 16);
}
inline void dequant_q8_0(const uint8_t* b, float* dst) {
  const __m512 d = _mm512_set1_ps(load_f16(b));
  store_i8x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), d, dst);
  store_i8x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)), d, dst + 16);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline void store_u8x8(__m128i q, __m256 scale, __m256 offset, float* dst) {
  _mm256_storeu_ps(dst, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), scale, offset));
}
inline void dequant_nibbles(const uint8_t* qs, float scale, float offset, float* dst) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  const __m256 vs = _mm256_set1_ps(scale), vo = _mm256_set1_ps(offset);
  store_u8x8(lo, vs, vo, dst);
  store_u8x8(_mm_srli_si128(lo, 8), vs, vo, dst + 8);
  store_u8x8(hi, vs, vo, dst + 16);
  store_u8x8(_mm_srli_si128(hi, 8), vs, vo, dst + 24);
}
inline void dequant_q8_0(const uint8_t* b, float* dst) {
  const __m256 d = _mm256_set1_ps(load_f16(b));
  for (int i = 0; i < 4; ++i) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
    _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
  }
}
#else
// 16 bytes of nibbles: low nibbles are values 0..15, high nibbles 16..31.
inline void dequant_nibbles(const uint8_t* qs, float scale, float offset, float* dst) {
  for (int j = 0; j < 16; ++j) {
    dst[j] = scale * static_cast<float>(qs[j] & 15) + offset;
    dst[j + 16] = scale * static_cast<float>(qs[j] >> 4) + offset;
  }
}
inline void dequant_q8_0(const uint8_t* b, float* dst) {
  const float d = load_f16(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) dst[j] = d * static_cast<float>(qs[j]);
}
#endif

// d * (q - 8) = d * q - 8 d.
inline void dequant_q4_0(const uint8_t* b, float* dst) {
  const float d = load_f16(b);
  dequant_nibbles(b + 2, d, -8.0f * d, dst);
}

inline void dequant_q4_1(const uint8_t* b, float* dst) { dequant_nibbles(b + 4, load_f16(b), load_f16(b + 2), dst); }

// Sub-block j's 6-bit scale and min of a Q4_K / Q5_K super-block (`s`: its 12 scale bytes).
inline void k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K and Q5_K: per pair of sub-blocks (64 values), y[l] = d0 * q - m0 for the low
// nibbles and y[l + 32] = d1 * q - m1 for the high ones; Q5_K adds a fifth bit from qh
// (bit 2 pair of qh[l] for the low sub-block, the next bit for the high one).
#if defined(__AVX2__) && defined(__FMA__)
// 32 unsigned bytes q -> dst[32] = scale * q - offset.
inline void store_affine_u8x32(__m256i q, float scale, float offset, float* dst) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  const __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + 8 * i, _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), s, o));
  }
}

template <bool kFifthBit>
inline void dequant_k_super_block(const uint8_t* b, float* dst) {
  const float d = load_f16(b);
  const float dmin = load_f16(b + 2);
  const uint8_t* scales = b + 4;
  const __m256i low4 = _mm256_set1_epi8(15), fifth = _mm256_set1_epi8(16);
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
  const uint8_t* qs = kFifthBit ? b + 48 : b + 16;
  for (int pair = 0; pair < 4; ++pair) {
    int sc0, mn0, sc1, mn1;
    k_scale_min(scales, 2 * pair, &sc0, &mn0);
    k_scale_min(scales, 2 * pair + 1, &sc1, &mn1);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * pair));
    __m256i lo = _mm256_and_si256(q, low4);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
    if (kFifthBit) {  // 16 where the bit is set: compare the masked byte with the mask
      const __m256i bit0 = _mm256_set1_epi8(static_cast<char>(1 << (2 * pair)));
      const __m256i bit1 = _mm256_set1_epi8(static_cast<char>(1 << (2 * pair + 1)));
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit0), bit0), fifth));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit1), bit1), fifth));
    }
    store_affine_u8x32(lo, d * static_cast<float>(sc0), dmin * static_cast<float>(mn0), dst + 64 * pair);
    store_affine_u8x32(hi, d * static_cast<float>(sc1), dmin * static_cast<float>(mn1), dst + 64 * pair + 32);
  }
}
#else
template <bool kFifthBit>
inline void dequant_k_super_block(const uint8_t* b, float* dst) {
  const float d = load_f16(b);
  const float dmin = load_f16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = kFifthBit ? b + 48 : b + 16;
  for (int pair = 0; pair < 4; ++pair) {
    int sc0, mn0, sc1, mn1;
    k_scale_min(scales, 2 * pair, &sc0, &mn0);
    k_scale_min(scales, 2 * pair + 1, &sc1, &mn1);
    const float d0 = d * static_cast<float>(sc0), m0 = dmin * static_cast<float>(mn0);
    const float d1 = d * static_cast<float>(sc1), m1 = dmin * static_cast<float>(mn1);
    const uint8_t* q = qs + 32 * pair;
    float* y = dst + 64 * pair;
    for (int l = 0; l < 32; ++l) {
      int lo = q[l] & 15, hi = q[l] >> 4;
      if (kFifthBit) {
        lo |= ((qh[l] >> (2 * pair)) & 1) << 4;
        hi |= ((qh[l] >> (2 * pair + 1)) & 1) << 4;
      }
      y[l] = d0 * static_cast<float>(lo) - m0;
      y[l + 32] = d1 * static_cast<float>(hi) - m1;
    }
  }
}
#endif

// 256-value super-blocks: dst[256].
inline void dequant_q4_k(const uint8_t* b, float* dst) { dequant_k_super_block<false>(b, dst); }

inline void dequant_q5_k(const uint8_t* b, float* dst) { dequant_k_super_block<true>(b, dst); }

#if defined(__AVX2__) && defined(__FMA__)
// 32 signed bytes q (values of one 32-value group, two scales of 16) -> dst[32] = s * q.
inline void store_scaled_i8x32(__m256i q, float s_lo, float s_hi, float* dst) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m256 a = _mm256_set1_ps(s_lo), b = _mm256_set1_ps(s_hi);
  _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), a));
  _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), a));
  _mm256_storeu_ps(dst + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), b));
  _mm256_storeu_ps(dst + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), b));
}

// Q6_K with 32-byte vectors: per half, low nibbles of ql[0..31] / ql[32..63] and their high
// nibbles give the four 32-value groups; qh supplies 2 high bits each (bits 0-1, 2-3, 4-5, 6-7).
inline void dequant_q6_k(const uint8_t* b, float* dst) {
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = load_f16(b + 208);
  const __m256i low4 = _mm256_set1_epi8(15), bits45 = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
  for (int half = 0; half < 2; ++half) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
    const __m256i q[4] = {
        _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), bits45)),
        _mm256_or_si256(_mm256_and_si256(c, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), bits45)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4), _mm256_and_si256(h, bits45)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low4),
                        _mm256_and_si256(_mm256_srli_epi16(h, 2), bits45)),
    };
    const int8_t* sc = scales + 8 * half;
    for (int g = 0; g < 4; ++g) {
      store_scaled_i8x32(_mm256_sub_epi8(q[g], bias), d * static_cast<float>(sc[2 * g]),
                         d * static_cast<float>(sc[2 * g + 1]), dst + 128 * half + 32 * g);
    }
  }
}
#else
inline void dequant_q6_k(const uint8_t* b, float* dst) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = load_f16(b + 208);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* l4 = ql + 64 * half;
    const uint8_t* h2 = qh + 32 * half;
    const int8_t* sc = scales + 8 * half;
    float* y = dst + 128 * half;
    for (int g = 0; g < 2; ++g) {  // 16 values per scale: the inner loop has constant scales
      const float s1 = d * static_cast<float>(sc[g]), s2 = d * static_cast<float>(sc[g + 2]);
      const float s3 = d * static_cast<float>(sc[g + 4]), s4 = d * static_cast<float>(sc[g + 6]);
      for (int l = 16 * g; l < 16 * g + 16; ++l) {
        const int q1 = ((l4[l] & 15) | ((h2[l] & 3) << 4)) - 32;
        const int q2 = ((l4[l + 32] & 15) | (((h2[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4)) - 32;
        y[l] = s1 * static_cast<float>(q1);
        y[l + 32] = s2 * static_cast<float>(q2);
        y[l + 64] = s3 * static_cast<float>(q3);
        y[l + 96] = s4 * static_cast<float>(q4);
      }
    }
  }
}

#endif

// Blocks [first_block, first_block + num_values / kValues) of a row into dst[num_values].
template <int kValues, int kBytes, void (*kDequant)(const uint8_t*, float*)>
inline void dequant_blocks(const uint8_t* row, int64_t first_block, int32_t num_values, float* dst) {
  for (int32_t i = 0; i < num_values / kValues; ++i) kDequant(row + (first_block + i) * kBytes, dst + kValues * i);
}

/// Dequantizes `num_values` values (whole blocks) starting at block `first_block` of the
/// row at `row` into dst[num_values].
inline void dequantize_range(QuantType type, const uint8_t* row, int64_t first_block, int32_t num_values,
                             float* dst) {
  switch (type) {
    case QuantType::kQ4_0: return dequant_blocks<32, 18, dequant_q4_0>(row, first_block, num_values, dst);
    case QuantType::kQ4_1: return dequant_blocks<32, 20, dequant_q4_1>(row, first_block, num_values, dst);
    case QuantType::kQ8_0: return dequant_blocks<32, 34, dequant_q8_0>(row, first_block, num_values, dst);
    case QuantType::kQ4_K: return dequant_blocks<256, 144, dequant_q4_k>(row, first_block, num_values, dst);
    case QuantType::kQ5_K: return dequant_blocks<256, 176, dequant_q5_k>(row, first_block, num_values, dst);
    case QuantType::kQ6_K: return dequant_blocks<256, 210, dequant_q6_k>(row, first_block, num_values, dst);
    case QuantType::kQ4_1x4:
    case QuantType::kQ8_0x4:
    case QuantType::kQ4_1x8:
    case QuantType::kQ8_0x8: return;  // never: quant_matmul.cpp unpacks x4 and x8 rows first
  }
}

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm
