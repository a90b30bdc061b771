// The decode path of the quantized matmul for the 32-value formats (Q4_0, Q4_1, Q8_0), compiled
// once per instruction set like quant_matmul_impl.h: x rows are quantized to 8 bits per 32
// values (ggml's Q8_1 scheme: d = max|x| / 127, q = round(x / d), s = d * sum(q)), and each
// weight block meets each x block in integer arithmetic, one scale multiply per block pair:
//   Q8_0: d_w * d_x * sum(q_w * q_x)
//   Q4_0: d_w * d_x * sum(q_w * q_x) - 8 * d_w * s_x          (value = d_w * (q_w - 8))
//   Q4_1: d_w * d_x * sum(q_w * q_x) + m_w * s_x              (value = d_w * q_w + m_w)
// No weight is ever turned into a float, which is what makes the bandwidth-bound decode case
// fast. The price is x's rounding: |error| <= sum_k |w_k| * d_x / 2 per block (tests check it).
//
// Blocks go in pairs (b, b + 1 for even b). x's bytes are stored pair by pair in the order
// the AVX2 kernel multiplies them: [x_b[0:16], x_b+1[0:16], x_b[16:32], x_b+1[16:32]], so one
// 256-bit register holds the first halves of both blocks and a weight register built the same
// way (two 16-byte loads) meets it with one maddubs; 4-bit weights need no shuffle at all, as a
// Q4 block's 16 bytes hold its low nibbles (values 0-15) and high nibbles (16-31). Each 128-bit
// lane then holds one block's partial sums (how they are scaled: see below).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_blocks.h"  // load_f16, in namespace qmm
#include "quant_task.h"

namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm {

constexpr int kXRowsPerPass = 4;  // x rows whose accumulators stay in registers together
constexpr int kDotStreams = 4;    // weight rows per decode tile, one from each quarter of a task

// Where byte j (0..31) of x block b sits within its row of QuantizedX::q (pair order above).
inline int64_t x_byte_offset(int32_t b, int32_t j) { return (b / 2) * 64 + (j / 16) * 32 + (b % 2) * 16 + j % 16; }

/// Quantizes `m` rows of `k` values (k a multiple of 32) into q [m, q_stride] (pair order;
/// q_stride = quant_x_row_bytes(k), the missing partner of an odd last block zero), d, s and
/// sums [m, k / 32].
inline void quantize_rows_q8(const float* x, int64_t x_stride, int64_t m, int32_t k, int8_t* q, float* d,
                             float* s, int32_t* sums) {
  const int32_t blocks = k / 32;
  const int64_t q_stride = quant_x_row_bytes(k);
  for (int64_t i = 0; i < m; ++i) {
    int8_t* q_row = q + i * q_stride;
    if (blocks % 2 != 0) {
      std::memset(q_row + x_byte_offset(blocks, 0), 0, 16);
      std::memset(q_row + x_byte_offset(blocks, 16), 0, 16);
    }
    for (int32_t b = 0; b < blocks; ++b) {
      const float* v = x + i * x_stride + 32 * b;
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
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3])),
          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q_row + x_byte_offset(b, 0)), _mm256_castsi256_si128(bytes));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q_row + x_byte_offset(b, 16)), _mm256_extracti128_si256(bytes, 1));
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
        q_row[x_byte_offset(b, j)] = static_cast<int8_t>(r);
        sum += r;
      }
#endif
      const float scale = amax / 127.0f;
      d[i * blocks + b] = scale;
      s[i * blocks + b] = scale * static_cast<float>(sum);
      sums[i * blocks + b] = sum;
    }
  }
}

template <QuantType T>
constexpr int32_t block_bytes() {
  return T == QuantType::kQ4_0 ? 18 : T == QuantType::kQ4_1 ? 20 : 34;
}

#if defined(__AVX2__)
// Every integer kernel computes four (weight row, x row) dot products at once, one per lane:
// for each block pair the exact integer sums of all four combinations are reduced into one
// vector, [I_0 .. I_3 of block b | I_0 .. I_3 of block b + 1], converted once and scaled
// once (scale_add). The decode path's four combinations are four weight rows against one x
// row, the GEMM's one weight row against four x rows; the lane arithmetic is the same:
//   scaled = fma(d_w * d_x, I, scaled); offset = fma(o_w, o_x, offset)   (o: header offsets)
// block by block in order, even blocks in lanes 0-3 and odd ones in lanes 4-7, and the result
// is (scaled + offset) in lane j plus the same in lane j + 4. So a (weight row, x row) result
// is bitwise the same whatever kernel, tile, task or thread count it falls in. Per block pair
// and combination this costs 2 maddubs and a quarter each of madd, cvt, mul and the two FMAs,
// against 7 multiply-class uops when each combination was scaled on its own.
//
// Software prefetch: each step touches every tile row kPrefetchRows rows further on in its
// stream (see run_dot_task_typed; possibly past the matrix: a prefetch never faults). The
// hardware prefetcher alone does not keep up with rows read side by side (weights from memory,
// Zen 3, one thread, m = 1: Q8_0 16-18 -> 8 cycles per block, Q4_1 k = 1536 11-13 -> 5-6).
// Four rows ahead rather than one: a Zen 1 decode step of the default model 9.4 -> 9.2 ms.
constexpr int kPrefetchRows = 4;
constexpr int kCombos = 4;  // (weight row, x row) combinations per vector
static_assert(kCombos == kDotStreams, "a decode tile's rows fill one vector's combinations");

// The byte dot product: sums of 4 adjacent unsigned x signed byte products added to int32
// lanes. With VNNI (the avx512vnni and avx2vnni builds) one vpdpbusd; VPAGE_EMULATE_VNNI gives
// the same arithmetic on AVX2 (tests/cpp/test_quant_vnni.cpp runs that build's code on any x86
// CPU). Without VNNI the kernels use maddubs (int16 pair sums) instead and widen later.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VPAGE_QMM_DOT4 1  // add_dot4 exists (quant_dot_x8.h builds on it)
constexpr bool kVnni = true;
inline __m256i add_dot4(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_epi32(acc, u8, s8); }
#elif defined(__AVXVNNI__)
#define VPAGE_QMM_DOT4 1
constexpr bool kVnni = true;
inline __m256i add_dot4(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
#elif defined(VPAGE_EMULATE_VNNI)
#define VPAGE_QMM_DOT4 1
constexpr bool kVnni = true;
inline __m256i add_dot4(__m256i acc, __m256i u8, __m256i s8) {
  // Even and odd bytes widened to int16 (u8 zero-, s8 sign-extended); each madd sums 2 of the 4.
  const __m256i u_even = _mm256_and_si256(u8, _mm256_set1_epi16(0xff)), u_odd = _mm256_srli_epi16(u8, 8);
  const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s8, 8), 8), s_odd = _mm256_srai_epi16(s8, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
}
#else
constexpr bool kVnni = false;
#endif

// Whether pair_products' lanes are int32 (Q8_0, and every format with VNNI) or int16 pair
// sums (Q4 with maddubs). Either way the reductions below give the same exact block sums.
template <QuantType T>
constexpr bool kInt32Products = T == QuantType::kQ8_0 || kVnni;

template <QuantType T>
constexpr int32_t weight_offset() {
  return T == QuantType::kQ4_1 ? 4 : 2;
}

// The bytes of one weight block pair, b and b + 1, that meet x's halves [0:16] and [16:32]
// (Q4: nibbles 0-15; Q8_0: int8, and their absolute values, maddubs' unsigned operand).
template <QuantType T>
struct PairBytes {
  __m256i lo, hi;
};
template <>
struct PairBytes<QuantType::kQ8_0> {
  __m256i lo, hi, abs_lo, abs_hi;
};

// kFull = false: block b alone (an odd block count's last block; x's missing partner is zero,
// and nothing past block b is read).
template <QuantType T, bool kFull>
inline PairBytes<T> pair_bytes(const uint8_t* blk) {
  constexpr int32_t kBytes = block_bytes<T>();
  auto half = [&](int32_t offset_in_block) {  // 16 weight bytes of block b (low lane) and b + 1
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + offset_in_block));
    if constexpr (kFull) {
      return _mm256_inserti128_si256(_mm256_castsi128_si256(lo),
                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kBytes + offset_in_block)),
                                     1);
    } else {
      return _mm256_zextsi128_si256(lo);
    }
  };
  PairBytes<T> w;
  if constexpr (T == QuantType::kQ8_0) {
    w.lo = half(2);
    w.hi = half(18);
    w.abs_lo = _mm256_sign_epi8(w.lo, w.lo);
    w.abs_hi = _mm256_sign_epi8(w.hi, w.hi);
  } else {
    const __m256i raw = half(weight_offset<T>());
    const __m256i mask = _mm256_set1_epi8(15);
    w.lo = _mm256_and_si256(raw, mask);
    w.hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
  }
  return w;
}

// The f16 headers of blocks b and b + 1 as floats: [d_b, m_b, ., ., d_b+1, m_b+1, ., .] (m:
// Q4_1 only; the "." lanes are weight bytes read as f16, possibly NaN, never used). Block b
// alone (kFull = false): zeros in lanes 4-7.
template <QuantType T, bool kFull>
inline __m256 pair_header(const uint8_t* blk) {
  __m128i head = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk));
  if constexpr (kFull) {
    head = _mm_castpd_si128(
        _mm_loadh_pd(_mm_castsi128_pd(head), reinterpret_cast<const double*>(blk + block_bytes<T>())));
  }
  return _mm256_cvtph_ps(head);
}

// The integer products of a weight pair and one x row's pair (x: its 64 bytes), not yet
// summed per block: int32 sums of 8 products (kInt32Products), or Q4's int16 sums of 4
// products of at most 15 * 127.
template <QuantType T>
inline __m256i pair_products(const PairBytes<T>& w, const int8_t* x) {
  const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
  if constexpr (kVnni) {
    // The unsigned operand: Q4 nibbles, or |w| with w's sign moved onto x (Q8_0).
    if constexpr (T == QuantType::kQ8_0) {
      return add_dot4(add_dot4(_mm256_setzero_si256(), w.abs_lo, _mm256_sign_epi8(x_lo, w.lo)), w.abs_hi,
                      _mm256_sign_epi8(x_hi, w.hi));
    } else {
      return add_dot4(add_dot4(_mm256_setzero_si256(), w.lo, x_lo), w.hi, x_hi);
    }
  } else if constexpr (T == QuantType::kQ8_0) {
    // maddubs multiplies unsigned by signed bytes: |w| by x with w's sign (|sums| <= 2 * 128 * 127).
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i p_lo = _mm256_maddubs_epi16(w.abs_lo, _mm256_sign_epi8(x_lo, w.lo));
    const __m256i p_hi = _mm256_maddubs_epi16(w.abs_hi, _mm256_sign_epi8(x_hi, w.hi));
    return _mm256_add_epi32(_mm256_madd_epi16(p_lo, ones), _mm256_madd_epi16(p_hi, ones));
  } else {
    return _mm256_add_epi16(_mm256_maddubs_epi16(w.lo, x_lo), _mm256_maddubs_epi16(w.hi, x_hi));
  }
}

// The sums of four combinations' products, in two steps of two shuffles and an add each
// (hadd did the same, but a vphaddw/vphaddd takes 2 cycles on Zen 3 against half a cycle
// for a shuffle: the GEMM runs 1.05-1.16x faster without it, with the same results).
// Step 1, two combinations -> 32-bit slot j of each lane holds combination j % 2's partial
// sums: one int32, or (Q4 with maddubs) two int16 of 8 products each (at most 8 * 15 * 127:
// no overflow).
template <QuantType T>
inline __m256i interleave_two(__m256i p0, __m256i p1) {
  const __m256i lo = _mm256_unpacklo_epi32(p0, p1), hi = _mm256_unpackhi_epi32(p0, p1);
  return kInt32Products<T> ? _mm256_add_epi32(lo, hi) : _mm256_add_epi16(lo, hi);
}

// Step 2, combinations 0, 1 and 2, 3 -> [I_0, I_1, I_2, I_3 | the same for block b + 1],
// exact (Q4: 16 products per int16, at most 16 * 15 * 127, then int32).
template <QuantType T>
inline __m256i combine_halves(__m256i s01, __m256i s23) {
  const __m256i lo = _mm256_unpacklo_epi64(s01, s23), hi = _mm256_unpackhi_epi64(s01, s23);
  if constexpr (kInt32Products<T>) {
    return _mm256_add_epi32(lo, hi);
  } else {
    return _mm256_madd_epi16(_mm256_add_epi16(lo, hi), _mm256_set1_epi16(1));
  }
}

// Both steps: four combinations' products -> [I_0 .. I_3 | block b + 1].
template <QuantType T>
inline __m256i reduce_lanes(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
  return combine_halves<T>(interleave_two<T>(p0, p1), interleave_two<T>(p2, p3));
}

// The accumulators of four combinations (lanes as in reduce_lanes): the scaled integer sums
// and the header offsets in two chains, so that consecutive block pairs' FMAs do not wait on
// each other (one chain of two dependent FMAs per pair bounded the Q4 GEMM by FMA latency).
struct LaneSums {
  __m256 scaled = _mm256_setzero_ps(), offset = _mm256_setzero_ps();
};

// The scale step of every integer kernel: d_w, d_x the scales, o_w, o_x the header offset's
// factors (Q4_1: m_w and s_x; Q4_0: d_w and -8 s_x; Q8_0: none).
// The chains are independent: a kernel may also run them in separate loops.
inline void add_scaled(__m256i sums, __m256 d_w, __m256 d_x, LaneSums& acc) {
  acc.scaled = _mm256_fmadd_ps(_mm256_mul_ps(d_w, d_x), _mm256_cvtepi32_ps(sums), acc.scaled);
}
template <QuantType T>
inline void add_offset(__m256 o_w, __m256 o_x, LaneSums& acc) {
  if constexpr (T != QuantType::kQ8_0) acc.offset = _mm256_fmadd_ps(o_w, o_x, acc.offset);
}
template <QuantType T>
inline void scale_add(__m256i sums, __m256 d_w, __m256 d_x, __m256 o_w, __m256 o_x, LaneSums& acc) {
  add_scaled(sums, d_w, d_x, acc);
  add_offset<T>(o_w, o_x, acc);
}

// Lane j's dot product: the two chains added, then its even blocks' sum plus its odd blocks'.
inline __m128 lane_results(const LaneSums& acc) {
  const __m256 v = _mm256_add_ps(acc.scaled, acc.offset);
  return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

// The decode tiles' x scales: for x row i and block pair p, kXPairFloats floats at
// (i * pairs + p) * kXPairFloats, [d_2p x4 | d_2p+1 x4] and [o_2p x4 | o_2p+1 x4]: row i's
// values of QuantizedX::pairs spread over a block's 4 lanes, as scale_add takes them. Built
// once per task, so that each tile loads them instead of permuting the group's vectors (on
// Zen 1 ~5% of a decode tile's time: vpage-bench-quant-tile).
inline const float* spread_pair_scales(const QuantizedX& x, int64_t m, int32_t blocks) {
  thread_local std::vector<float> spread;
  const int32_t pairs = (blocks + 1) / 2;
  spread.resize(static_cast<size_t>(m) * pairs * kXPairFloats);
  for (int64_t i = 0; i < m; ++i) {
    const int lane = static_cast<int>(i % kCombos);
    const __m256i index = _mm256_setr_epi32(lane, lane, lane, lane, lane + 4, lane + 4, lane + 4, lane + 4);
    for (int32_t p = 0; p < pairs; ++p) {
      const float* group = x.pairs + ((i / kCombos) * pairs + p) * kXPairFloats;
      float* out = spread.data() + (i * pairs + p) * kXPairFloats;
      _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(_mm256_loadu_ps(group), index));
      _mm256_storeu_ps(out + 8, _mm256_permutevar8x32_ps(_mm256_loadu_ps(group + 8), index));
    }
  }
  return spread.data();
}

// One block pair (b, b + 1) of a decode tile: its four weight rows' bytes `w` and scales
// (d_w, o_w in scale_add's lanes) against x rows [0, MR) (xq, xs as dot_tile takes them).
template <QuantType T, int MR>
inline void tile_pair(const PairBytes<T> w[kCombos], __m256 d_w, __m256 o_w, int32_t b, const int8_t* xq,
                      int64_t x_stride, const float* xs, int64_t xs_stride, LaneSums acc[MR]) {
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    const int8_t* x = xq + i * x_stride + 32 * static_cast<int64_t>(b);
    const float* scales = xs + i * xs_stride + (b / 2) * kXPairFloats;
    const __m256i sums = reduce_lanes<T>(pair_products<T>(w[0], x), pair_products<T>(w[1], x),
                                         pair_products<T>(w[2], x), pair_products<T>(w[3], x));
    scale_add<T>(sums, d_w, _mm256_loadu_ps(scales), o_w, _mm256_loadu_ps(scales + 8), acc[i]);
  }
}

// A decode tile's results: out[r * out_stride + i] for weight row r and x row i.
template <int MR>
inline void store_tile(const LaneSums acc[MR], float* out, int out_stride) {
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
    alignas(16) float lanes[kCombos];
    _mm_store_ps(lanes, lane_results(acc[i]));
    for (int r = 0; r < kCombos; ++r) out[r * out_stride + i] = lanes[r];
  }
}

// Decode tile: weight rows rows[0..4) (pointers to their first block; a row may repeat, its
// results unused) against x rows [0, MR) of one x group (xq: the group's first
// row, x_stride bytes apart; xs: its spread_pair_scales, xs_stride floats apart).
// out[r * out_stride + i].
template <QuantType T, int MR>
inline void dot_tile(const uint8_t* const rows[kCombos], int64_t prefetch, int32_t blocks, const int8_t* xq,
                     int64_t x_stride, const float* xs, int64_t xs_stride, float* out, int out_stride) {
  constexpr int32_t kBytes = block_bytes<T>();
  LaneSums acc[MR];
  auto step = [&](auto full, int32_t b) {
    constexpr bool kFull = decltype(full)::value;
    PairBytes<T> w[kCombos];
    __m256 head[kCombos];
#pragma GCC unroll 4
    for (int r = 0; r < kCombos; ++r) {
      const uint8_t* blk = rows[r] + static_cast<int64_t>(b) * kBytes;
      if constexpr (kFull) _mm_prefetch(reinterpret_cast<const char*>(blk + prefetch), _MM_HINT_T0);
      w[r] = pair_bytes<T, kFull>(blk);
      head[r] = pair_header<T, kFull>(blk);
    }
    // [d_0, d_1, m_0, m_1 | ...] and [d_2, d_3, m_2, m_3 | ...] -> [d_0 .. d_3 | ...], [m_0 .. m_3 | ...]
    const __m256 h01 = _mm256_unpacklo_ps(head[0], head[1]), h23 = _mm256_unpacklo_ps(head[2], head[3]);
    const __m256 d_w = _mm256_shuffle_ps(h01, h23, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 o_w = T == QuantType::kQ4_1 ? _mm256_shuffle_ps(h01, h23, _MM_SHUFFLE(3, 2, 3, 2)) : d_w;
    tile_pair<T, MR>(w, d_w, o_w, b, xq, x_stride, xs, xs_stride, acc);
  };
  int32_t b = 0;
  for (; b + 2 <= blocks; b += 2) step(std::true_type{}, b);
  if (b < blocks) step(std::false_type{}, b);
  store_tile<MR>(acc, out, out_stride);
}

// Q4_K on the same lane arithmetic: a 256-value super-block (d, dmin, twelve bytes of 6-bit
// sub-block scales and mins, 128 bytes of nibbles) is eight 32-value sub-blocks, each exactly
// a Q4_1 block with d_w = d * scale_j and m_w = -dmin * min_j. Its nibbles come in 32-byte runs
// per sub-block pair (low nibbles: sub-block 2g, high: 2g + 1), and two lane permutes turn them
// into Q4_1's pair layout. The scales of a tile's four rows are decoded once per super-block,
// [sub-block][row], so that a pair's d_w and m_w vectors are plain loads.
constexpr int32_t kQ4KBytes = 144;

// The eight scales and mins of super-block `blk` times d and -dmin, as 8-float vectors.
inline void q4k_scales(const uint8_t* blk, __m256& d_w, __m256& m_w) {
  uint32_t word[3];
  std::memcpy(word, blk + 4, 12);
  // Bytes 0-3 of the results: sub-blocks 0-3 (low 6 bits of bytes 0-3 and 4-7); bytes 4-7:
  // sub-blocks 4-7 (nibbles of bytes 8-11 plus the top 2 bits of bytes 0-3 and 4-7).
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
  const uint64_t scales = (word[0] & low6) |
                          static_cast<uint64_t>((word[2] & low4) | (((word[0] >> 6) & top2) << 4)) << 32;
  const uint64_t mins = (word[1] & low6) |
                        static_cast<uint64_t>(((word[2] >> 4) & low4) | (((word[1] >> 6) & top2) << 4)) << 32;
  auto floats = [](uint64_t bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes))));
  };
  d_w = _mm256_mul_ps(_mm256_set1_ps(load_f16(blk)), floats(scales));
  m_w = _mm256_mul_ps(_mm256_set1_ps(-load_f16(blk + 2)), floats(mins));
}

// v[r] = row r's 8 sub-block values -> out[g] = [sub 2g of rows 0-3 | sub 2g + 1 of rows 0-3].
inline void q4k_transpose(const __m256 v[kCombos], __m256 out[4]) {
  const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));  // subs 0 | 4
  const __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));  // subs 1 | 5
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));  // subs 2 | 6
  const __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));  // subs 3 | 7
  out[0] = _mm256_permute2f128_ps(u0, u1, 0x20);
  out[1] = _mm256_permute2f128_ps(u2, u3, 0x20);
  out[2] = _mm256_permute2f128_ps(u0, u1, 0x31);
  out[3] = _mm256_permute2f128_ps(u2, u3, 0x31);
}

// Sub-blocks 2g and 2g + 1 of a super-block as a Q4_1 pair (qs: their 32 bytes of nibbles).
inline PairBytes<QuantType::kQ4_1> q4k_pair_bytes(const uint8_t* qs) {
  const __m256i mask = _mm256_set1_epi8(15);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
  const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
  // [sub 2g values 0-15 | sub 2g + 1 values 0-15] and values 16-31 of both.
  return {_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31)};
}

// dot_tile for Q4_K rows (k / 256 super-blocks each).
template <int MR>
inline void dot_tile_q4k(const uint8_t* const rows[kCombos], int64_t prefetch, int32_t blocks, const int8_t* xq,
                         int64_t x_stride, const float* xs, int64_t xs_stride, float* out, int out_stride) {
  LaneSums acc[MR];
  for (int32_t b0 = 0; b0 < blocks; b0 += 8) {
    const int64_t super = static_cast<int64_t>(b0 / 8) * kQ4KBytes;
    __m256 d_row[kCombos], m_row[kCombos], d_pair[4], m_pair[4];
    for (int r = 0; r < kCombos; ++r) q4k_scales(rows[r] + super, d_row[r], m_row[r]);
    q4k_transpose(d_row, d_pair);
    q4k_transpose(m_row, m_pair);
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const int32_t b = b0 + 2 * g;
      PairBytes<QuantType::kQ4_1> w[kCombos];
#pragma GCC unroll 4
      for (int r = 0; r < kCombos; ++r) {
        const uint8_t* qs = rows[r] + super + 16 + 32 * g;
        _mm_prefetch(reinterpret_cast<const char*>(qs + prefetch), _MM_HINT_T0);
        w[r] = q4k_pair_bytes(qs);
      }
      tile_pair<QuantType::kQ4_1, MR>(w, d_pair[g], m_pair[g], b, xq, x_stride, xs, xs_stride, acc);
    }
  }
  store_tile<MR>(acc, out, out_stride);
}

// values [tiles, kCombos, mr]: tile j's rows stream[s] + (t0 + j) * row_bytes (s < kCombos; a
// stream without that row, stream_rows[s] <= t0 + j, repeats stream 0's row and its results are
// not used) against x rows [i0, i0 + mr), i0 a multiple of kCombos (one x group), mr <= kXRowsPerPass.
// spread: spread_pair_scales of all x rows.
template <QuantType T>
inline void dot_tiles(const uint8_t* const stream[kDotStreams], const int32_t stream_rows[kDotStreams], int64_t row_bytes,
                      int32_t t0, int32_t tiles, int32_t blocks, const QuantizedX& x, const float* spread, int64_t i0,
                      int mr, float* values) {
  static_assert(kXRowsPerPass == kCombos, "a pass covers one x group");
  const int8_t* xq = x.q + i0 * x.q_stride;
  const int64_t xs_stride = quant_x_group_floats(blocks);  // a row's spread scales: as many floats as a group's
  const float* xs = spread + i0 * xs_stride;
  const int64_t prefetch = kPrefetchRows * row_bytes;
  for (int32_t j = 0; j < tiles; ++j) {
    const int32_t t = t0 + j;
    const uint8_t* tile[kCombos];
    for (int s = 0; s < kCombos; ++s) tile[s] = (t < stream_rows[s] ? stream[s] : stream[0]) + t * row_bytes;
    float* out = values + j * kCombos * mr;
    if constexpr (T == QuantType::kQ4_K) {
      switch (mr) {
        case 1: dot_tile_q4k<1>(tile, prefetch, blocks, xq, x.q_stride, xs, xs_stride, out, 1); break;
        case 2: dot_tile_q4k<2>(tile, prefetch, blocks, xq, x.q_stride, xs, xs_stride, out, 2); break;
        case 3: dot_tile_q4k<3>(tile, prefetch, blocks, xq, x.q_stride, xs, xs_stride, out, 3); break;
        default: dot_tile_q4k<4>(tile, prefetch, blocks, xq, x.q_stride, xs, xs_stride, out, 4); break;
      }
    } else {
      switch (mr) {
        case 1: dot_tile<T, 1>(tile, prefetch, blocks, xq, x.q_stride, xs, xs_stride, out, 1); break;
        case 2: dot_tile<T, 2>(tile, prefetch, blocks, xq, x.q_stride, xs, xs_stride, out, 2); break;
        case 3: dot_tile<T, 3>(tile, prefetch, blocks, xq, x.q_stride, xs, xs_stride, out, 3); break;
        default: dot_tile<T, 4>(tile, prefetch, blocks, xq, x.q_stride, xs, xs_stride, out, 4); break;
      }
    }
  }
}
#else
inline const float* spread_pair_scales(const QuantizedX&, int64_t, int32_t) { return nullptr; }  // AVX2 only

template <QuantType T>
inline void dot_tiles(const uint8_t* const stream[kDotStreams], const int32_t stream_rows[kDotStreams], int64_t row_bytes,
                      int32_t t0, int32_t tiles, int32_t blocks, const QuantizedX& x, const float* /*spread*/,
                      int64_t i0, int mr, float* values) {
  for (int32_t j = 0; j < tiles; ++j) {
    for (int st = 0; st < kDotStreams; ++st) {
      if (t0 + j >= stream_rows[st]) continue;
      const uint8_t* row = stream[st] + (t0 + j) * row_bytes;
      float* out = values + (j * kDotStreams + st) * mr;
      for (int i = 0; i < mr; ++i) out[i] = 0.0f;
      for (int32_t b = 0; b < blocks; ++b) {
        if constexpr (T == QuantType::kQ4_K) {  // sub-block b: a Q4_1 block, see dot_tile_q4k
          const uint8_t* blk = row + static_cast<int64_t>(b / 8) * 144;
          int sc = 0, mn = 0;
          k_scale_min(blk + 4, b % 8, &sc, &mn);
          const float dw = load_f16(blk) * static_cast<float>(sc), mw = -load_f16(blk + 2) * static_cast<float>(mn);
          const uint8_t* qs = blk + 16 + 32 * (b % 8 / 2);
          const int shift = 4 * (b % 2);
          for (int i = 0; i < mr; ++i) {
            const int8_t* xq = x.q + (i0 + i) * x.q_stride;
            const int64_t xb = (i0 + i) * blocks + b;
            int32_t dot = 0;
            for (int v = 0; v < 32; ++v) dot += ((qs[v] >> shift) & 15) * xq[x_byte_offset(b, v)];
            out[i] += dw * x.d[xb] * static_cast<float>(dot) + mw * x.s[xb];
          }
          continue;
        }
        const uint8_t* blk = row + static_cast<int64_t>(b) * block_bytes<T>();
        const float dw = load_f16(blk);
        for (int i = 0; i < mr; ++i) {
          const int8_t* xq = x.q + (i0 + i) * x.q_stride;
          const int64_t xb = (i0 + i) * blocks + b;
          int32_t dot = 0;
          if constexpr (T == QuantType::kQ8_0) {
            const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
            for (int v = 0; v < 32; ++v) dot += q[v] * xq[x_byte_offset(b, v)];
          } else {
            const uint8_t* qs = blk + (T == QuantType::kQ4_1 ? 4 : 2);
            for (int v = 0; v < 16; ++v) {
              dot += (qs[v] & 15) * xq[x_byte_offset(b, v)] + (qs[v] >> 4) * xq[x_byte_offset(b, v + 16)];
            }
          }
          out[i] += dw * x.d[xb] * static_cast<float>(dot);
          if constexpr (T == QuantType::kQ4_1) out[i] += load_f16(blk + 2) * x.s[xb];
          if constexpr (T == QuantType::kQ4_0) out[i] -= 8.0f * dw * x.s[xb];
        }
      }
    }
  }
}
#endif

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm
