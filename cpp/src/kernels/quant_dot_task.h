// The decode path's tasks: GGUF rows read as four quarter streams (their tiles are in
// quant_dot_impl.h), Q4_1x4 groups read as one (AVX2 builds; the tile is here), and
// run_dot_task, the entry point the dispatcher calls. Compiled once per instruction set like quant_dot_impl.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_dot_impl.h"

namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm {

// A task's weight rows are read as kDotStreams streams, its quarters, and a tile takes one row
// from each: rows side by side in memory would put up to four read streams in one 4 KiB page,
// and the L2 streamer follows one per page (weights from memory, one thread, Q4_1 at
// k = 2048: 10.9 GB/s with consecutive rows against 14.6 at k = 8192, whose 5 KiB rows keep
// one stream per page). kDotChunkTiles tiles are taken at a time, and each chunk meets all x
// rows (kXRowsPerPass at a time) while it is in L1. Which rows share a tile changes nothing
// in a row's result.
constexpr int32_t kDotChunkTiles = 4;

template <QuantType T>
inline void run_dot_task_typed(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  const int32_t n0 = static_cast<int32_t>(task * rows_per_task);
  const int32_t rows = std::min(rows_per_task, a.n - n0);
  const int32_t blocks = a.k / 32;  // x's blocks; Q4_K: sub-blocks
  const int64_t row_bytes = static_cast<int64_t>(a.k / quant_block_values(T)) * quant_block_bytes(T);
  const int32_t quarter = (rows + kDotStreams - 1) / kDotStreams;  // tiles; the last streams may be shorter
  const uint8_t* stream[kDotStreams];
  int32_t stream_rows[kDotStreams];
  for (int s = 0; s < kDotStreams; ++s) {
    stream[s] = a.weight + (n0 + static_cast<int64_t>(s) * quarter) * row_bytes;
    stream_rows[s] = std::max(0, std::min(quarter, rows - s * quarter));
  }
  thread_local std::vector<float> out_buffer;  // [m, rows_per_task] for quant_store_out
  out_buffer.resize(static_cast<size_t>(a.m) * rows_per_task);
  float* out_rows = out_buffer.data();
  float values[kDotChunkTiles * kDotStreams * kXRowsPerPass];
  const float* spread = spread_pair_scales(x, a.m, blocks);
  for (int32_t t0 = 0; t0 < quarter; t0 += kDotChunkTiles) {
    const int32_t tiles = std::min(kDotChunkTiles, quarter - t0);
    for (int64_t i0 = 0; i0 < a.m; i0 += kXRowsPerPass) {
      const int mr = static_cast<int>(std::min<int64_t>(kXRowsPerPass, a.m - i0));
      dot_tiles<T>(stream, stream_rows, row_bytes, t0, tiles, blocks, x, spread, i0, mr, values);
      for (int32_t j = 0; j < tiles; ++j) {
        for (int s = 0; s < kDotStreams; ++s) {
          if (t0 + j >= stream_rows[s]) continue;
          const float* v = values + (j * kDotStreams + s) * mr;
          for (int i = 0; i < mr; ++i) out_rows[(i0 + i) * rows_per_task + s * quarter + t0 + j] = v[i];
        }
      }
    }
  }
  for (int64_t i = 0; i < a.m; ++i) quant_store_out(a, i, n0, rows, out_rows + i * rows_per_task);
}

#if defined(__AVX2__)
// The decode tile on one group of kQ4_1x4 rows (layout: QuantType): per block pair the four
// rows' d and m are one f16 vector each and a row's two blocks of nibbles one 32-byte load,
// so dot_tile's per-row header conversions, lane shuffles and 128-bit inserts are gone
// (vpage-bench-quant-tile, Zen 1: 13-16% fewer cycles). The same arithmetic in the same order:
// bitwise dot_tile<kQ4_1>'s results for the rows the group was repacked from.
template <int MR>
inline void dot_tile_x4(const uint8_t* group, int64_t prefetch, int32_t blocks, const int8_t* xq, int64_t x_stride,
                        const float* xs, int64_t xs_stride, float* out, int out_stride) {
  constexpr QuantType T = QuantType::kQ4_1;
  const __m256i mask = _mm256_set1_epi8(15);
  LaneSums acc[MR];
  for (int32_t b = 0; b < blocks; b += 2) {
    const uint8_t* pair = group + (b / 2) * kQ4_1x4PairBytes;
    for (int64_t line = 0; line < kQ4_1x4PairBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(pair + prefetch + line), _MM_HINT_T0);
    }
    const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
    const __m256 o_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 16)));
    PairBytes<T> w[kCombos];
#pragma GCC unroll 4
    for (int r = 0; r < kCombos; ++r) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 32 + 32 * r));
      w[r].lo = _mm256_and_si256(raw, mask);
      w[r].hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    }
    tile_pair<T, MR>(w, d_w, o_w, b, xq, x_stride, xs, xs_stride, acc);
  }
  store_tile<MR>(acc, out, out_stride);
}

// run_dot_task on kQ4_1x4 rows: a tile is a group, whose rows are one contiguous run, so the
// tiles need no quarter streams.
inline void run_dot_task_x4(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  const int32_t n0 = static_cast<int32_t>(task * rows_per_task);  // a multiple of 4, as rows_per_task
  const int32_t groups = std::min(rows_per_task, a.n - n0) / kCombos;
  const int32_t blocks = a.k / 32;  // even
  const int64_t group_bytes = (blocks / 2) * kQ4_1x4PairBytes;
  const uint8_t* first = a.weight + n0 / kCombos * group_bytes;
  thread_local std::vector<float> out_buffer;  // [m, rows_per_task] for quant_store_out
  out_buffer.resize(static_cast<size_t>(a.m) * rows_per_task);
  float* out_rows = out_buffer.data();
  float values[kDotChunkTiles * kCombos * kXRowsPerPass];
  const float* spread = spread_pair_scales(x, a.m, blocks);
  const int64_t xs_stride = quant_x_group_floats(blocks);
  const int64_t prefetch = kPrefetchRows * group_bytes;
  for (int32_t g0 = 0; g0 < groups; g0 += kDotChunkTiles) {
    const int32_t tiles = std::min(kDotChunkTiles, groups - g0);
    for (int64_t i0 = 0; i0 < a.m; i0 += kXRowsPerPass) {
      const int mr = static_cast<int>(std::min<int64_t>(kXRowsPerPass, a.m - i0));
      const int8_t* xq = x.q + i0 * x.q_stride;
      const float* xs = spread + i0 * xs_stride;
      for (int32_t j = 0; j < tiles; ++j) {
        const uint8_t* group = first + (g0 + j) * group_bytes;
        float* out = values + j * kCombos * mr;
        switch (mr) {
          case 1: dot_tile_x4<1>(group, prefetch, blocks, xq, x.q_stride, xs, xs_stride, out, 1); break;
          case 2: dot_tile_x4<2>(group, prefetch, blocks, xq, x.q_stride, xs, xs_stride, out, 2); break;
          case 3: dot_tile_x4<3>(group, prefetch, blocks, xq, x.q_stride, xs, xs_stride, out, 3); break;
          default: dot_tile_x4<4>(group, prefetch, blocks, xq, x.q_stride, xs, xs_stride, out, 4); break;
        }
      }
      for (int32_t j = 0; j < tiles; ++j) {
        for (int r = 0; r < kCombos; ++r) {
          const float* v = values + (j * kCombos + r) * mr;
          for (int i = 0; i < mr; ++i) out_rows[(i0 + i) * rows_per_task + kCombos * (g0 + j) + r] = v[i];
        }
      }
    }
  }
  for (int64_t i = 0; i < a.m; ++i) quant_store_out(a, i, n0, groups * kCombos, out_rows + i * rows_per_task);
}
constexpr bool kIntegerQ4_1x4 = true;
#else
constexpr bool kIntegerQ4_1x4 = false;  // the scalar loops read GGUF rows: kQ4_1x4 is unpacked first
#endif

inline void run_dot_task(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  switch (a.type) {
    case QuantType::kQ4_0: return run_dot_task_typed<QuantType::kQ4_0>(a, x, rows_per_task, task);
    case QuantType::kQ4_1: return run_dot_task_typed<QuantType::kQ4_1>(a, x, rows_per_task, task);
    case QuantType::kQ8_0: return run_dot_task_typed<QuantType::kQ8_0>(a, x, rows_per_task, task);
    case QuantType::kQ4_K: return run_dot_task_typed<QuantType::kQ4_K>(a, x, rows_per_task, task);
#if defined(__AVX2__)
    case QuantType::kQ4_1x4: return run_dot_task_x4(a, x, rows_per_task, task);
#endif
    default: return;  // the dispatcher sends only the 32-value formats, Q4_K and (SIMD) Q4_1x4 here
  }
}

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm
