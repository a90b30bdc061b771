// The integer GEMM path of the quantized matmul for the 32-value formats (Q4_0, Q4_1, Q8_0)
// and more x rows than the decode path takes (quant_dot_impl.h, whose scheme and x layout it
// shares). The decode path rebuilds each weight block pair (nibble split, f16 header
// conversion) for every kXRowsPerPass x rows; here a task unpacks its weight rows once into a
// tile of WeightPairs, and a register-blocked micro-kernel (kGemmWeightRows weight rows x
// kGemmXRows x rows) reuses each weight register across x rows and each x register across
// weight rows. Compiled once per instruction set like quant_dot_impl.h.
//
// Invariant: every (weight row, x row) pair runs pair_madd over the block pairs in order into
// its own 8-lane accumulator, then reduce8, exactly as dot_tile does, so a row's output is
// bitwise the same whatever m, tile, task or thread count (and whichever integer path) it
// falls in.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_dot_impl.h"

namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm {

#if defined(__AVX2__)
// Micro-kernel shape: 2 x 3 keeps 6 accumulators, 4 weight vectors, 2 x vectors and the
// temporaries within the 16 ymm registers.
constexpr int kGemmWeightRows = 2;
constexpr int kGemmXRows = 3;
// x rows per pass over the tile: about this many bytes of x (q and pairs: 2 bytes per value)
// stay in L1 while every weight row of the tile (in L2) meets them.
constexpr int64_t kGemmXChunkBytes = 24 << 10;

// Tile layout: [rows, pairs] WeightPairs (32-byte aligned, Q4's abs_lo/abs_hi unused), the
// same values weight_pair gives the decode path (an odd count's last pair: block b alone).
template <QuantType T>
inline void unpack_weight_rows(const uint8_t* w, int64_t row_bytes, int32_t rows, int32_t blocks, WeightPair* tile) {
  constexpr int32_t kBytes = block_bytes<T>();
  const int32_t pairs = (blocks + 1) / 2;
  for (int32_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + r * row_bytes;
    WeightPair* out = tile + static_cast<int64_t>(r) * pairs;
    int32_t b = 0;
    for (; b + 2 <= blocks; b += 2) out[b / 2] = weight_pair<T, true>(row + static_cast<int64_t>(b) * kBytes);
    if (b < blocks) out[b / 2] = weight_pair<T, false>(row + static_cast<int64_t>(b) * kBytes);
  }
}

// out[i * out_stride + r] = dot(tile row r, x row i) for r < NW, i < MR; tile rows at stride
// `pairs`, x rows (pair order) at stride x_stride bytes, their pair floats at pair_stride.
template <QuantType T, int NW, int MR>
inline void gemm_tile(const WeightPair* tile, int32_t pairs, const int8_t* xq, int64_t x_stride, const float* xp,
                      int64_t pair_stride, float* out, int64_t out_stride) {
  __m256 acc[NW][MR];
#pragma GCC unroll 4
  for (int r = 0; r < NW; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) acc[r][i] = _mm256_setzero_ps();
  }
  for (int32_t p = 0; p < pairs; ++p) {
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const int8_t* xi = xq + i * x_stride + 64 * static_cast<int64_t>(p);
      const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi));
      const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + 32));
      const float* pi = xp + i * pair_stride + static_cast<int64_t>(p) * kXPairFloats;
#pragma GCC unroll 4
      for (int r = 0; r < NW; ++r) acc[r][i] = pair_madd<T>(tile[r * pairs + p], x_lo, x_hi, pi, acc[r][i]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < NW; ++r) {
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) out[i * out_stride + r] = reduce8(acc[r][i]);
  }
}

// x rows [0, mr) (mr <= kGemmXRows) against NW tile rows.
template <QuantType T, int NW>
inline void gemm_x_rows(int mr, const WeightPair* tile, int32_t pairs, const int8_t* xq, int64_t x_stride,
                        const float* xp, int64_t pair_stride, float* out, int64_t out_stride) {
  static_assert(kGemmXRows == 3, "one case per row count");
  switch (mr) {
    case 3: return gemm_tile<T, NW, 3>(tile, pairs, xq, x_stride, xp, pair_stride, out, out_stride);
    case 2: return gemm_tile<T, NW, 2>(tile, pairs, xq, x_stride, xp, pair_stride, out, out_stride);
    default: return gemm_tile<T, NW, 1>(tile, pairs, xq, x_stride, xp, pair_stride, out, out_stride);
  }
}

template <QuantType T>
inline void run_gemm_task_typed(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  const int32_t n0 = static_cast<int32_t>(task * rows_per_task);
  const int32_t rows = std::min(rows_per_task, a.n - n0);
  const int32_t blocks = a.k / 32;
  const int32_t pairs = (blocks + 1) / 2;
  const int64_t row_bytes = static_cast<int64_t>(blocks) * quant_block_bytes(T);
  const int64_t pair_stride = static_cast<int64_t>(pairs) * kXPairFloats;
  const int64_t x_row_bytes = x.q_stride + pair_stride * static_cast<int64_t>(sizeof(float));
  const int64_t x_chunk = std::max<int64_t>(kGemmXRows, kGemmXChunkBytes / x_row_bytes / kGemmXRows * kGemmXRows);
  thread_local std::vector<WeightPair> tile;  // [rows_per_task, pairs]
  thread_local std::vector<float> out_rows;   // [x_chunk, rows_per_task] for quant_store_out
  tile.resize(static_cast<size_t>(rows_per_task) * pairs);
  out_rows.resize(static_cast<size_t>(x_chunk) * rows_per_task);
  unpack_weight_rows<T>(a.weight + n0 * row_bytes, row_bytes, rows, blocks, tile.data());
  for (int64_t i0 = 0; i0 < a.m; i0 += x_chunk) {
    const int64_t mc = std::min(x_chunk, a.m - i0);
    int32_t r = 0;
    for (; r < rows; r += kGemmWeightRows) {
      const bool full = r + kGemmWeightRows <= rows;
      const WeightPair* t = tile.data() + static_cast<int64_t>(r) * pairs;
      for (int64_t i = 0; i < mc; i += kGemmXRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kGemmXRows, mc - i));
        const int8_t* xq = x.q + (i0 + i) * x.q_stride;
        const float* xp = x.pairs + (i0 + i) * pair_stride;
        float* out = out_rows.data() + i * rows_per_task + r;
        if (full) {
          gemm_x_rows<T, kGemmWeightRows>(mr, t, pairs, xq, x.q_stride, xp, pair_stride, out, rows_per_task);
        } else {
          for (int32_t j = r; j < rows; ++j) {
            gemm_x_rows<T, 1>(mr, t + (j - r) * pairs, pairs, xq, x.q_stride, xp, pair_stride, out + (j - r),
                              rows_per_task);
          }
        }
      }
    }
    for (int64_t i = 0; i < mc; ++i) quant_store_out(a, i0 + i, n0, rows, out_rows.data() + i * rows_per_task);
  }
}

/// Integer GEMM task: weight rows [task * rows_per_task, ...) against all x rows.
inline void run_gemm_task(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  switch (a.type) {
    case QuantType::kQ4_0: return run_gemm_task_typed<QuantType::kQ4_0>(a, x, rows_per_task, task);
    case QuantType::kQ4_1: return run_gemm_task_typed<QuantType::kQ4_1>(a, x, rows_per_task, task);
    case QuantType::kQ8_0: return run_gemm_task_typed<QuantType::kQ8_0>(a, x, rows_per_task, task);
    default: return;  // the dispatcher sends only the 32-value formats here
  }
}
#else
// Without SIMD the decode path's scalar loop serves any number of x rows.
inline void run_gemm_task(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  run_dot_task(a, x, rows_per_task, task);
}
#endif

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm
