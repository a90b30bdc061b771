// The integer GEMM path of the quantized matmul for the 32-value formats (Q4_0, Q4_1, Q8_0)
// and more x rows than the decode path takes (quant_dot_impl.h, whose scheme and x layout it
// shares). The decode path rebuilds each weight block pair (nibble split, f16 header
// conversion) for every kXRowsPerPass x rows; here a task unpacks its weight rows once into a
// tile of WeightPairs, and the micro-kernel reuses each unpacked pair, held in registers,
// across kGemmXRows x rows. Compiled once per instruction set like quant_dot_impl.h.
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
// Micro-kernel: one weight row against kGemmXRows x rows, the weight pair's four vectors held
// in registers across the x rows. Measured on Zen 3 (one thread, Q4_1 and Q8_0, k = 576 and
// 1536, m = 64 and 512) against 2x3, 3x2, 2x4, 4x2, 1x6 and 1x8 (weight x x rows): 1x4 was
// the fastest, by 5-20%; the kernel is bound by the vector ALU ports (7 multiply-class uops
// per block pair and x row for Q4, 9 for Q8_0), not by loads.
constexpr int kGemmXRows = 4;
// x rows per pass over the tile: about this many bytes of x (q and pairs: 2 bytes per value)
// stay in L1 while every weight row of the tile (in L2) meets them.
constexpr int64_t kGemmXChunkBytes = 24 << 10;

// Tile layout: [rows, pairs] WeightPairs (32-byte aligned; 128 bytes per pair for Q4, 160
// for Q8_0), the same values weight_pair gives the decode path (an odd count's last pair:
// block b alone).
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

// out[i * out_stride] = dot(tile row, x row i) for i < MR; x rows (pair order) at stride
// x_stride bytes, their pair floats at pair_stride.
template <QuantType T, int MR>
inline void gemm_tile(const WeightPair<T>* row, int32_t pairs, const int8_t* xq, int64_t x_stride, const float* xp,
                      int64_t pair_stride, float* out, int64_t out_stride) {
  __m256 acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int32_t p = 0; p < pairs; ++p) {
    const WeightPair<T> w = row[p];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const int8_t* xi = xq + i * x_stride + 64 * static_cast<int64_t>(p);
      const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi));
      const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + 32));
      acc[i] = pair_madd<T>(w, x_lo, x_hi, xp + i * pair_stride + static_cast<int64_t>(p) * kXPairFloats, acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) out[i * out_stride] = reduce8(acc[i]);
}

// x rows [0, mr) (1 <= mr <= MR) against one tile row.
template <QuantType T, int MR = kGemmXRows>
inline void gemm_x_rows(int mr, const WeightPair<T>* row, int32_t pairs, const int8_t* xq, int64_t x_stride,
                        const float* xp, int64_t pair_stride, float* out, int64_t out_stride) {
  if constexpr (MR > 1) {
    if (mr < MR) return gemm_x_rows<T, MR - 1>(mr, row, pairs, xq, x_stride, xp, pair_stride, out, out_stride);
  }
  gemm_tile<T, MR>(row, pairs, xq, x_stride, xp, pair_stride, out, out_stride);
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
  thread_local std::vector<WeightPair<T>> tile;  // [rows_per_task, pairs]
  thread_local std::vector<float> out_rows;      // [x_chunk, rows_per_task] for quant_store_out
  tile.resize(static_cast<size_t>(rows_per_task) * pairs);
  out_rows.resize(static_cast<size_t>(x_chunk) * rows_per_task);
  unpack_weight_rows<T>(a.weight + n0 * row_bytes, row_bytes, rows, blocks, tile.data());
  for (int64_t i0 = 0; i0 < a.m; i0 += x_chunk) {
    const int64_t mc = std::min(x_chunk, a.m - i0);
    for (int32_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < mc; i += kGemmXRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kGemmXRows, mc - i));
        gemm_x_rows<T>(mr, tile.data() + static_cast<int64_t>(r) * pairs, pairs, x.q + (i0 + i) * x.q_stride,
                       x.q_stride, x.pairs + (i0 + i) * pair_stride, pair_stride,
                       out_rows.data() + i * rows_per_task + r, rows_per_task);
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
