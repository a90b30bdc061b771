// The integer GEMM path of the quantized matmul for the 32-value formats (Q4_0, Q4_1, Q8_0)
// and more x rows than the decode path takes (quant_dot_impl.h, whose scheme and x layout it
// shares). The decode path rebuilds each weight block pair (nibble split, f16 header
// conversion) for every kXRowsPerPass x rows; here a task unpacks its weight rows once into a
// tile of WeightPairs, and the micro-kernel reuses each unpacked pair, held in registers,
// across the 4 x rows of an x group. Compiled once per instruction set like quant_dot_impl.h.
//
// Invariant: every (weight row, x row) pair goes through the lane arithmetic of scale_add,
// block by block, exactly as dot_tile does, so a row's output is bitwise the same whatever m,
// tile, task or thread count (and whichever integer path) it falls in.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_dot_task.h"

namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm {

#if defined(__AVX2__)
// Micro-kernel (gemm_tile): two weight rows against the kCombos x rows of an x group, each
// weight pair loaded once per x group.
//
// x rows per pass over the tile: about this many bytes of x (q and pairs: 2 bytes per value)
// stay in L1 while every weight row of the tile (in L2) meets them.
constexpr int64_t kGemmXChunkBytes = 24 << 10;

// One weight block pair as the GEMM keeps it unpacked: its bytes and the header's scales in
// the lanes of scale_add, [d_b x4 | d_b+1 x4] (and Q4_1's [m_b x4 | m_b+1 x4]).
template <QuantType T>
struct WeightPair {
  PairBytes<T> bytes;
  __m256 d_w;
};
template <>
struct WeightPair<QuantType::kQ4_1> {
  PairBytes<QuantType::kQ4_1> bytes;
  __m256 d_w, m_w;
};

template <QuantType T, bool kFull>
inline WeightPair<T> weight_pair(const uint8_t* blk) {
  WeightPair<T> w;
  w.bytes = pair_bytes<T, kFull>(blk);
  const __m256 head = pair_header<T, kFull>(blk);
  w.d_w = _mm256_permute_ps(head, 0);
  if constexpr (T == QuantType::kQ4_1) w.m_w = _mm256_permute_ps(head, 0x55);
  return w;
}

template <QuantType T>
inline __m256 offset_factor(const WeightPair<T>& w) {
  if constexpr (T == QuantType::kQ4_1) {
    return w.m_w;
  } else {
    return w.d_w;  // Q4_0: d_w * (-8 s_x); unused for Q8_0
  }
}

// Tile layout: [rows, pairs] WeightPairs (32-byte aligned; an odd count's last pair: block b
// alone).
template <QuantType T>
inline void unpack_weight_rows(const uint8_t* w, int64_t row_bytes, int32_t rows, int32_t blocks,
                               WeightPair<T>* tile) {
  constexpr int32_t kBytes = block_bytes<T>();
  const int32_t pairs = (blocks + 1) / 2;
  for (int32_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + r * row_bytes;
    WeightPair<T>* out = tile + static_cast<int64_t>(r) * pairs;
    int32_t b = 0;
    for (; b + 2 <= blocks; b += 2) out[b / 2] = weight_pair<T, true>(row + static_cast<int64_t>(b) * kBytes);
    if (b < blocks) out[b / 2] = weight_pair<T, false>(row + static_cast<int64_t>(b) * kBytes);
  }
}

// Q4_K rows unpacked as Q4_1 pairs (see dot_tile_q4k): sub-blocks 2g and 2g + 1 of a super-block
// are one pair, with d * scale and -dmin * min as its d_w and m_w. The GEMM then runs them as
// Q4_1, through the lane arithmetic of the decode path's Q4_K tiles.
inline void unpack_q4k_rows(const uint8_t* w, int64_t row_bytes, int32_t rows, int32_t blocks,
                            WeightPair<QuantType::kQ4_1>* tile) {
  const int32_t pairs = blocks / 2;
  for (int32_t r = 0; r < rows; ++r) {
    WeightPair<QuantType::kQ4_1>* out = tile + static_cast<int64_t>(r) * pairs;
    for (int32_t b0 = 0; b0 < blocks; b0 += 8) {
      const uint8_t* blk = w + r * row_bytes + static_cast<int64_t>(b0 / 8) * kQ4KBytes;
      __m256 d_w, m_w;
      q4k_scales(blk, d_w, m_w);
      for (int g = 0; g < 4; ++g) {
        const __m256i lanes = _mm256_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1);
        WeightPair<QuantType::kQ4_1>& pair = out[b0 / 2 + g];
        pair.bytes = q4k_pair_bytes(blk + 16 + 32 * g);
        pair.d_w = _mm256_permutevar8x32_ps(d_w, lanes);
        pair.m_w = _mm256_permutevar8x32_ps(m_w, lanes);
      }
    }
  }
}

// x4 rows (a multiple of 4; layout: QuantType) unpacked as their file type's rows would be.
template <QuantType T>
inline void unpack_x4_rows(const uint8_t* w, int32_t rows, int32_t blocks, WeightPair<quant_file_type(T)>* tile) {
  const int32_t pairs = blocks / 2;  // even
  const __m256i mask = _mm256_set1_epi8(15);
  for (int32_t g = 0; g < rows / kCombos; ++g) {
    for (int32_t p = 0; p < pairs; ++p) {
      const uint8_t* pair = w + (static_cast<int64_t>(g) * pairs + p) * x4_pair_bytes<T>();
      const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
      [[maybe_unused]] const __m256 m_w =  // Q4_1x4 only
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 16)));
      for (int r = 0; r < kCombos; ++r) {
        const __m256i lanes = _mm256_setr_epi32(r, r, r, r, r + 4, r + 4, r + 4, r + 4);
        WeightPair<quant_file_type(T)>& out = tile[static_cast<int64_t>(kCombos * g + r) * pairs + p];
        out.d_w = _mm256_permutevar8x32_ps(d_w, lanes);
        if constexpr (T == QuantType::kQ8_0x4) {
          const __m256i* q = reinterpret_cast<const __m256i*>(pair + 16 + 64 * r);
          out.bytes.lo = _mm256_loadu_si256(q);
          out.bytes.hi = _mm256_loadu_si256(q + 1);
          out.bytes.abs_lo = _mm256_sign_epi8(out.bytes.lo, out.bytes.lo);
          out.bytes.abs_hi = _mm256_sign_epi8(out.bytes.hi, out.bytes.hi);
        } else {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 32 + 32 * r));
          out.bytes.lo = _mm256_and_si256(raw, mask);
          out.bytes.hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
          out.m_w = _mm256_permutevar8x32_ps(m_w, lanes);
        }
      }
    }
  }
}

// The quant bytes of rows 0-7 of an x8 group's block from four of its vectors (v[j]: bytes 4j ..
// 4j + 3 of row r in 4-byte lane r), a transpose of 4-byte lanes: rows[i] = [16 bytes of row i |
// 16 bytes of row i + 4].
inline void x8_block_rows(const __m256i v[4], __m256i rows[4]) {
  const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
  rows[0] = _mm256_unpacklo_epi64(t0, t2);
  rows[1] = _mm256_unpackhi_epi64(t0, t2);
  rows[2] = _mm256_unpacklo_epi64(t1, t3);
  rows[3] = _mm256_unpackhi_epi64(t1, t3);
}

// x8 rows (a multiple of 8; layout: QuantType) unpacked as their file type's rows would be:
// per group and block pair, both blocks' vectors transposed into rows, each row's two blocks
// joined as pair_bytes joins them. An odd count's last pair: block b alone (the missing block's
// bytes zero, Q8_0x8's +128 included, and its scales zero).
template <QuantType T>
inline void unpack_x8_rows(const uint8_t* w, int32_t rows, int32_t blocks, WeightPair<quant_file_type(T)>* tile) {
  constexpr bool kQ8 = T == QuantType::kQ8_0x8;
  constexpr int64_t kBytes = quant_x8_block_bytes(T);
  constexpr int kHalves = kQ8 ? 2 : 1;  // Q8_0: quants 0-15 and 16-31, four vectors each
  const int32_t pairs = (blocks + 1) / 2;
  const __m256i bias = _mm256_set1_epi8(kQ8 ? static_cast<char>(0x80) : 0);
  const __m256i mask = _mm256_set1_epi8(15);
  for (int32_t g = 0; g < rows / 8; ++g) {
    for (int32_t p = 0; p < pairs; ++p) {
      __m256i block_rows[2][kHalves][4];  // [block of the pair][half][rows i | i + 4]
      alignas(32) float d[2][8] = {}, m[2][8] = {};
      for (int h = 0; h < 2; ++h) {
        const int32_t b = 2 * p + h;
        const uint8_t* blk = w + (static_cast<int64_t>(g) * blocks + b) * kBytes;
        for (int half = 0; half < kHalves; ++half) {
          __m256i v[4];
          for (int j = 0; j < 4; ++j) {
            v[j] = b < blocks ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (kQ8 ? 16 : 32) +
                                                                                    32 * (4 * half + j)))
                              : bias;
          }
          x8_block_rows(v, block_rows[h][half]);
        }
        if (b < blocks) {
          _mm256_store_ps(d[h], _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk))));
          if (!kQ8) _mm256_store_ps(m[h], _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16))));
        }
      }
      for (int r = 0; r < 8; ++r) {
        auto joined = [&](int half) {  // row r's 16 bytes of both blocks: low (r < 4) or high halves
          const __m256i b0 = block_rows[0][half][r % 4], b1 = block_rows[1][half][r % 4];
          return _mm256_xor_si256(
              r < 4 ? _mm256_permute2x128_si256(b0, b1, 0x20) : _mm256_permute2x128_si256(b0, b1, 0x31), bias);
        };
        WeightPair<quant_file_type(T)>& out = tile[static_cast<int64_t>(8 * g + r) * pairs + p];
        out.d_w = _mm256_setr_m128(_mm_set1_ps(d[0][r]), _mm_set1_ps(d[1][r]));
        if constexpr (kQ8) {
          out.bytes.lo = joined(0);
          out.bytes.hi = joined(1);
          out.bytes.abs_lo = _mm256_sign_epi8(out.bytes.lo, out.bytes.lo);
          out.bytes.abs_hi = _mm256_sign_epi8(out.bytes.hi, out.bytes.hi);
        } else {
          const __m256i raw = joined(0);
          out.bytes.lo = _mm256_and_si256(raw, mask);
          out.bytes.hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
          out.m_w = _mm256_setr_m128(_mm_set1_ps(m[0][r]), _mm_set1_ps(m[1][r]));
        }
      }
    }
  }
}

// out[r + i * out_stride] = dot(tile row r, x row i) for r < NW, i < mr; rows: NW tile rows
// `pairs` apart; x[0..4): the group's rows (pair order; a short group repeats a row), xp: the
// group's pair floats. With two weight rows the x rows go two at a time, each meeting both
// weight rows while loaded, and the offset chains run in a second loop, so that the 16 vector
// registers hold the products and the FMA chains without spilling.
template <QuantType T, int NW>
inline void gemm_tile(const WeightPair<T>* rows, int32_t pairs, const int8_t* const x[kCombos], const float* xp,
                      int mr, float* out, int64_t out_stride) {
  LaneSums acc[NW];
  for (int32_t p = 0; p < pairs; ++p) {
    const int64_t offset = 64 * static_cast<int64_t>(p);
    __m256i half[NW][2];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const int8_t* xa = x[2 * h] + offset;
      const int8_t* xb = x[2 * h + 1] + offset;
      __m256i pa[NW], pb[NW];
#pragma GCC unroll 2
      for (int r = 0; r < NW; ++r) pa[r] = pair_products<T>(rows[r * static_cast<int64_t>(pairs) + p].bytes, xa);
#pragma GCC unroll 2
      for (int r = 0; r < NW; ++r) pb[r] = pair_products<T>(rows[r * static_cast<int64_t>(pairs) + p].bytes, xb);
#pragma GCC unroll 2
      for (int r = 0; r < NW; ++r) half[r][h] = interleave_two<T>(pa[r], pb[r]);
    }
    const __m256 d_x = _mm256_loadu_ps(xp + static_cast<int64_t>(p) * kXPairFloats);
#pragma GCC unroll 2
    for (int r = 0; r < NW; ++r) {
      add_scaled(combine_halves<T>(half[r][0], half[r][1]), rows[r * static_cast<int64_t>(pairs) + p].d_w, d_x, acc[r]);
    }
  }
  if constexpr (T != QuantType::kQ8_0) {
    for (int32_t p = 0; p < pairs; ++p) {
      const __m256 o_x = _mm256_loadu_ps(xp + static_cast<int64_t>(p) * kXPairFloats + 8);
#pragma GCC unroll 2
      for (int r = 0; r < NW; ++r) add_offset<T>(offset_factor(rows[r * static_cast<int64_t>(pairs) + p]), o_x, acc[r]);
    }
  }
  for (int r = 0; r < NW; ++r) {
    alignas(16) float lanes[kCombos];
    _mm_store_ps(lanes, lane_results(acc[r]));
    for (int i = 0; i < mr; ++i) out[r + i * out_stride] = lanes[i];
  }
}

// T: the weights' format; the tile holds them as K (Q4_K's pairs are Q4_1 pairs, an x4 type's
// its file type's).
template <QuantType T, QuantType K = T == QuantType::kQ4_K ? QuantType::kQ4_1 : quant_file_type(T)>
inline void run_gemm_task_typed(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  const int32_t n0 = static_cast<int32_t>(task * rows_per_task);
  const int32_t rows = std::min(rows_per_task, a.n - n0);
  const int32_t blocks = a.k / 32;  // x's blocks; Q4_K: sub-blocks
  const int32_t pairs = (blocks + 1) / 2;
  const int64_t row_bytes = static_cast<int64_t>(a.k / quant_block_values(T)) * quant_block_bytes(T);
  const int64_t group_floats = quant_x_group_floats(blocks);
  const int64_t x_row_bytes = x.q_stride + group_floats / kCombos * static_cast<int64_t>(sizeof(float));
  const int64_t x_chunk = std::max<int64_t>(kCombos, kGemmXChunkBytes / x_row_bytes / kCombos * kCombos);
  thread_local std::vector<WeightPair<K>> tile;  // [rows_per_task, pairs]
  thread_local std::vector<float> out_rows;      // [x_chunk, rows_per_task] for quant_store_out
  tile.resize(static_cast<size_t>(rows_per_task) * pairs);
  // float32 results go straight into out; 16-bit ones through out_rows and quant_store_out.
  const bool direct = a.dtype == DType::kFloat32;
  if (!direct) out_rows.resize(static_cast<size_t>(x_chunk) * rows_per_task);
  if constexpr (T == QuantType::kQ4_K) {
    unpack_q4k_rows(a.weight + n0 * row_bytes, row_bytes, rows, blocks, tile.data());
  } else if constexpr (quant_is_x4(T)) {
    unpack_x4_rows<T>(a.weight + n0 * row_bytes, rows, blocks, tile.data());
  } else if constexpr (quant_is_x8(T)) {
    unpack_x8_rows<T>(a.weight + n0 * row_bytes, rows, blocks, tile.data());
  } else {
    unpack_weight_rows<T>(a.weight + n0 * row_bytes, row_bytes, rows, blocks, tile.data());
  }
  for (int64_t i0 = 0; i0 < a.m; i0 += x_chunk) {  // i0: a multiple of kCombos (one x group)
    const int64_t mc = std::min(x_chunk, a.m - i0);
    const int64_t groups = (mc + kCombos - 1) / kCombos;
    const float* xp0 = x.pairs + i0 / kCombos * group_floats;
    float* out0 = direct ? static_cast<float*>(a.out) + i0 * a.out_stride + n0 : out_rows.data();
    const int64_t out_stride = direct ? a.out_stride : rows_per_task;
    for (int32_t r = 0; r < rows; r += 2) {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t i = g * kCombos;
        const int mr = static_cast<int>(std::min<int64_t>(kCombos, mc - i));
        const int8_t* x_rows[kCombos];
        for (int l = 0; l < kCombos; ++l) x_rows[l] = x.q + (i0 + i + std::min(l, mr - 1)) * x.q_stride;
        const WeightPair<K>* tile_rows = tile.data() + static_cast<int64_t>(r) * pairs;
        const float* xp = xp0 + g * group_floats;
        float* out = out0 + i * out_stride + r;
        if (r + 1 < rows) {
          gemm_tile<K, 2>(tile_rows, pairs, x_rows, xp, mr, out, out_stride);
        } else {
          gemm_tile<K, 1>(tile_rows, pairs, x_rows, xp, mr, out, out_stride);
        }
      }
    }
    if (!direct) {
      for (int64_t i = 0; i < mc; ++i) quant_store_out(a, i0 + i, n0, rows, out_rows.data() + i * rows_per_task);
    }
  }
}

/// Integer GEMM task: weight rows [task * rows_per_task, ...) against all x rows.
inline void run_gemm_task(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  switch (a.type) {
    case QuantType::kQ4_0: return run_gemm_task_typed<QuantType::kQ4_0>(a, x, rows_per_task, task);
    case QuantType::kQ4_1: return run_gemm_task_typed<QuantType::kQ4_1>(a, x, rows_per_task, task);
    case QuantType::kQ8_0: return run_gemm_task_typed<QuantType::kQ8_0>(a, x, rows_per_task, task);
    case QuantType::kQ4_K: return run_gemm_task_typed<QuantType::kQ4_K>(a, x, rows_per_task, task);
    case QuantType::kQ4_1x4: return run_gemm_task_typed<QuantType::kQ4_1x4>(a, x, rows_per_task, task);
    case QuantType::kQ8_0x4: return run_gemm_task_typed<QuantType::kQ8_0x4>(a, x, rows_per_task, task);
    case QuantType::kQ4_1x8: return run_gemm_task_typed<QuantType::kQ4_1x8>(a, x, rows_per_task, task);
    case QuantType::kQ8_0x8: return run_gemm_task_typed<QuantType::kQ8_0x8>(a, x, rows_per_task, task);
    default: return;  // the dispatcher sends only the 32-value formats, Q4_K and the x4 and x8 types here
  }
}
#else
// Without SIMD the decode path's scalar loop serves any number of x rows.
inline void run_gemm_task(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  run_dot_task(a, x, rows_per_task, task);
}
#endif

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm
