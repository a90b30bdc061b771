// The decode path of the quantized matmul for the 32-value formats (Q4_0, Q4_1, Q8_0), compiled
// once per instruction set like quant_matmul_impl.h: x rows are quantized to 8 bits per 32
// values (ggml's Q8_1 scheme: d = max|x| / 127, q = round(x / d), s = d * sum(q)), and each
// weight block meets each x block in integer arithmetic, one scale multiply per block pair:
//   Q8_0: d_w * d_x * sum(q_w * q_x)
//   Q4_0: d_w * d_x * sum(q_w * q_x) - 8 * d_w * s_x          (value = d_w * (q_w - 8))
//   Q4_1: d_w * d_x * sum(q_w * q_x) + m_w * s_x              (value = d_w * q_w + m_w)
// No weight is ever turned into a float, which is what makes the bandwidth-bound decode case
// fast. The price is x's rounding: |error| <= sum_k |w_k| * d_x / 2 per block (tests check it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"  // load_f16, in namespace qmm
#include "quant_task.h"

namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm {

constexpr int kXRowsPerPass = 4;  // x rows whose accumulators stay in registers together

/// Quantizes `m` rows of `k` values (k a multiple of 32) into q [m, k], d and s [m, k / 32].
inline void quantize_rows_q8(const float* x, int64_t x_stride, int64_t m, int32_t k, int8_t* q, float* d,
                             float* s) {
  const int32_t blocks = k / 32;
  for (int64_t i = 0; i < m; ++i) {
    for (int32_t b = 0; b < blocks; ++b) {
      const float* v = x + i * x_stride + 32 * b;
      int8_t* out = q + i * k + 32 * b;
#if defined(__AVX2__)
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 part[4], amax8 = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        part[j] = _mm256_loadu_ps(v + 8 * j);
        amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, part[j]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m256i r[4];
      for (int j = 0; j < 4; ++j) {
        r[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(part[j], inv), _MM_FROUND_TO_NEAREST_INT |
                                                                              _MM_FROUND_NO_EXC));
      }
      const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
      // Packing works within 128-bit lanes: the permute puts the 32 bytes back in order.
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
      const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1))));
#else
      float amax = 0.0f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int32_t r = static_cast<int32_t>(std::nearbyint(v[j] * inv));  // |r| <= 127
        out[j] = static_cast<int8_t>(r);
        sum += r;
      }
#endif
      const float scale = amax / 127.0f;
      d[i * blocks + b] = scale;
      s[i * blocks + b] = scale * static_cast<float>(sum);
    }
  }
}

template <QuantType T>
constexpr int32_t block_bytes() {
  return T == QuantType::kQ4_0 ? 18 : T == QuantType::kQ4_1 ? 20 : 34;
}

#if defined(__AVX2__)
// The 32 weights of one block as bytes ready for _mm256_maddubs_epi16, which multiplies
// unsigned by signed bytes: nibbles are already unsigned; Q8_0's signed weights become |w|,
// and their signs move onto x (sign_x).
inline __m256i nibbles_u8x32(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);  // values 0..15 low, 16..31 high
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

// Eight int32 partial sums of w * x over the block, as floats.
inline __m256 dot_u8_i8(__m256i w, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(w, x);  // |sums| <= 2 * 255 * 127: no saturation
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

inline float reduce8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// out[r * out_stride + i] = dot(weight row r, x row i) for r < NW, i < mr <= MR: NW * MR
// independent accumulator chains (one weight row alone would wait on its FMA latency).
template <QuantType T, int NW, int MR>
inline void dot_tile(const uint8_t* rows, int64_t row_bytes, int32_t blocks, const int8_t* xq, int32_t k,
                     const float* xd, const float* xs, int mr, float* out, int out_stride) {
  __m256 acc[NW][MR];
  float offset[NW][MR];
  for (int r = 0; r < NW; ++r) {
    for (int i = 0; i < MR; ++i) {
      acc[r][i] = _mm256_setzero_ps();
      offset[r][i] = 0.0f;
    }
  }
  for (int32_t b = 0; b < blocks; ++b) {
    for (int r = 0; r < NW; ++r) {
      const uint8_t* blk = rows + r * row_bytes + static_cast<int64_t>(b) * block_bytes<T>();
      const float dw = load_f16(blk);
      __m256i w;
      if constexpr (T == QuantType::kQ8_0) {
        w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      } else {
        w = nibbles_u8x32(blk + (T == QuantType::kQ4_1 ? 4 : 2));
      }
      const float off = T == QuantType::kQ4_1 ? load_f16(blk + 2) : -8.0f * dw;  // per unit of s_x
      for (int i = 0; i < MR; ++i) {
        if (i >= mr) break;
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * k + 32 * b));
        __m256 dot;
        if constexpr (T == QuantType::kQ8_0) {
          dot = dot_u8_i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
        } else {
          dot = dot_u8_i8(w, x);
        }
        acc[r][i] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[i * blocks + b]), dot, acc[r][i]);
        if constexpr (T != QuantType::kQ8_0) offset[r][i] += off * xs[i * blocks + b];
      }
    }
  }
  for (int r = 0; r < NW; ++r) {
    for (int i = 0; i < mr; ++i) out[r * out_stride + i] = reduce8(acc[r][i]) + offset[r][i];
  }
}

// One weight row against x rows [0, mr), mr <= kXRowsPerPass.
template <QuantType T>
inline void dot_row(const uint8_t* row, int32_t blocks, const int8_t* xq, int32_t k, const float* xd,
                    const float* xs, int mr, float* out) {
  dot_tile<T, 1, kXRowsPerPass>(row, 0, blocks, xq, k, xd, xs, mr, out, 0);
}

// Four weight rows against one x row (single-stream decode): out[r] for r < 4.
template <QuantType T>
inline void dot_4_rows(const uint8_t* rows, int64_t row_bytes, int32_t blocks, const int8_t* xq, const float* xd,
                       const float* xs, float* out) {
  dot_tile<T, 4, 1>(rows, row_bytes, blocks, xq, 0, xd, xs, 1, out, 1);
}
#else
template <QuantType T>
inline void dot_row(const uint8_t* row, int32_t blocks, const int8_t* xq, int32_t k, const float* xd,
                    const float* xs, int mr, float* out) {
  for (int i = 0; i < mr; ++i) out[i] = 0.0f;
  for (int32_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + static_cast<int64_t>(b) * block_bytes<T>();
    const float dw = load_f16(blk);
    for (int i = 0; i < mr; ++i) {
      const int8_t* x = xq + i * k + 32 * b;
      int32_t dot = 0;
      if constexpr (T == QuantType::kQ8_0) {
        const int8_t* w = reinterpret_cast<const int8_t*>(blk + 2);
        for (int j = 0; j < 32; ++j) dot += w[j] * x[j];
      } else {
        const uint8_t* qs = blk + (T == QuantType::kQ4_1 ? 4 : 2);
        for (int j = 0; j < 16; ++j) dot += (qs[j] & 15) * x[j] + (qs[j] >> 4) * x[j + 16];
      }
      out[i] += dw * xd[i * blocks + b] * static_cast<float>(dot);
      if constexpr (T == QuantType::kQ4_1) out[i] += load_f16(blk + 2) * xs[i * blocks + b];
      if constexpr (T == QuantType::kQ4_0) out[i] -= 8.0f * dw * xs[i * blocks + b];
    }
  }
}

template <QuantType T>
inline void dot_4_rows(const uint8_t* rows, int64_t row_bytes, int32_t blocks, const int8_t* xq, const float* xd,
                       const float* xs, float* out) {
  for (int r = 0; r < 4; ++r) dot_row<T>(rows + r * row_bytes, blocks, xq, 0, xd, xs, 1, out + r);
}
#endif

template <QuantType T>
inline void run_dot_task_typed(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  const int32_t n0 = static_cast<int32_t>(task * rows_per_task);
  const int32_t rows = std::min(rows_per_task, a.n - n0);
  const int32_t blocks = a.k / 32;
  const int64_t row_bytes = static_cast<int64_t>(blocks) * quant_block_bytes(T);
  float values[kXRowsPerPass];
  thread_local std::vector<float> out_buffer;  // [m, rows_per_task] for quant_store_out
  out_buffer.resize(static_cast<size_t>(a.m) * rows_per_task);
  float* out_rows = out_buffer.data();
  int32_t r = 0;
  if (a.m == 1) {
    for (; r + 4 <= rows; r += 4) {
      dot_4_rows<T>(a.weight + (n0 + r) * row_bytes, row_bytes, blocks, x.q, x.d, x.s, out_rows + r);
    }
  }
  for (; r < rows; ++r) {
    const uint8_t* row = a.weight + (n0 + r) * row_bytes;
    for (int64_t i0 = 0; i0 < a.m; i0 += kXRowsPerPass) {
      const int mr = static_cast<int>(std::min<int64_t>(kXRowsPerPass, a.m - i0));
      dot_row<T>(row, blocks, x.q + i0 * a.k, a.k, x.d + i0 * blocks, x.s + i0 * blocks, mr, values);
      for (int i = 0; i < mr; ++i) out_rows[(i0 + i) * rows_per_task + r] = values[i];
    }
  }
  for (int64_t i = 0; i < a.m; ++i) quant_store_out(a, i, n0, rows, out_rows + i * rows_per_task);
}

inline void run_dot_task(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  switch (a.type) {
    case QuantType::kQ4_0: return run_dot_task_typed<QuantType::kQ4_0>(a, x, rows_per_task, task);
    case QuantType::kQ4_1: return run_dot_task_typed<QuantType::kQ4_1>(a, x, rows_per_task, task);
    case QuantType::kQ8_0: return run_dot_task_typed<QuantType::kQ8_0>(a, x, rows_per_task, task);
    default: return;  // the dispatcher sends only the 32-value formats here
  }
}

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm
