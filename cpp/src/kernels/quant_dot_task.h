// The decode path's tasks: GGUF rows read as four quarter streams (their tiles are in
// quant_dot_impl.h), x4 groups read as one (AVX2 builds; their tiles are here), and
// run_dot_task, the entry point the dispatcher calls. Compiled once per instruction set like quant_dot_impl.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "quant_dot_impl.h"
#include "quant_dot_x8.h"

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
template <QuantType T>
constexpr int64_t x4_pair_bytes() {
  return T == QuantType::kQ8_0x4 ? kQ8_0x4PairBytes : kQ4_1x4PairBytes;
}

// How far ahead in its stream the x4 tile prefetches (Zen 3, the default model's matrices from
// DRAM at 1 and 5 x rows: Q8_0x4 1 KiB 3-19% faster than 9.6 KiB, no prefetch 30% slower at 4
// rows; Q4_1x4 1 KiB ahead 0.87-0.93x of the GGUF layout's time at 1 row against 0.93-0.99x
// at 4 KiB).
constexpr int64_t kX4PrefetchBytes = 1024;

// One block pair (b, b + 1) of an x4 group (layout: QuantType) against x rows [0, MR) (xq, xs
// as dot_tile takes them), into acc.
//   kQ4_1x4: the four rows' d and m are one f16 vector each and a row's two blocks of nibbles
//     one 32-byte load, so dot_tile's per-row header conversions, lane shuffles and 128-bit
//     inserts are gone (vpage-bench-quant-tile, Zen 1: 13-16% fewer cycles).
//   kQ8_0x4: one f16 vector of d and two 32-byte loads a row. The products are pair_products'
//     with the roles of w and x swapped, |x| x sign(w, x), so each x row's |x| serves the four
//     rows, where |w| x sign(x, w) took four registers a row (the 4-row tile spilled): exact
//     because kQ8_0x4 holds no -128 (quant_repack_x4) and |x| <= 127 (Zen 3: 16-37% fewer
//     cycles than dot_tile<kQ8_0> at 1-8 x rows).
// The same integers, lane arithmetic and order: bitwise dot_tile's results for the file's rows.
template <QuantType T, int MR>
inline void x4_pair(const uint8_t* pair, int32_t b, const int8_t* xq, int64_t x_stride,
                    const float* xs, int64_t xs_stride, LaneSums acc[MR]) {
  for (int64_t line = 0; line < x4_pair_bytes<T>(); line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(pair + kX4PrefetchBytes + line), _MM_HINT_T0);
  }
  const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
  if constexpr (T == QuantType::kQ8_0x4) {
    constexpr QuantType K = QuantType::kQ8_0;
    const int8_t* w = reinterpret_cast<const int8_t*>(pair + 16);  // row r: 64 bytes at 64 * r
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const int8_t* x = xq + i * x_stride + 32 * static_cast<int64_t>(b);
      PairBytes<K> xb;
      xb.lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      xb.hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
      xb.abs_lo = _mm256_sign_epi8(xb.lo, xb.lo);
      xb.abs_hi = _mm256_sign_epi8(xb.hi, xb.hi);
      const __m256i sums = reduce_lanes<K>(pair_products<K>(xb, w), pair_products<K>(xb, w + 64),
                                           pair_products<K>(xb, w + 128), pair_products<K>(xb, w + 192));
      add_scaled(sums, d_w, _mm256_loadu_ps(xs + i * xs_stride + (b / 2) * kXPairFloats), acc[i]);
    }
  } else {
    const __m256i mask = _mm256_set1_epi8(15);
    const __m256 o_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 16)));
    PairBytes<QuantType::kQ4_1> w[kCombos];
#pragma GCC unroll 4
    for (int r = 0; r < kCombos; ++r) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 32 + 32 * r));
      w[r].lo = _mm256_and_si256(raw, mask);
      w[r].hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    }
    tile_pair<QuantType::kQ4_1, MR>(w, d_w, o_w, b, xq, x_stride, xs, xs_stride, acc);
  }
}

// x rows [0, MR) against kDotStreams x4 groups, one from each quarter of a task, block pair by
// block pair (a group may repeat, its results unused): out[(j * kCombos + r) * MR + i].
// Reading four streams side by side keeps more DRAM reads in flight than a group at a time
// (Zen 3, one thread, 60 MB of Q8_0x4, one x row: 1.05x dot_tile<kQ8_0>'s speed against
// 0.6-0.8x group by group), and the accumulators that do not fit in registers cost less than
// the reloads of unpacked weights did (vpage-bench-quant-tile, Q4_1x4, 1 / 2 / 4 x rows: 1.51 /
// 1.37 / 1.21 cycles a block, row and x row against 1.78 / 1.53 / 1.26 group by group).
template <QuantType T, int MR>
inline void dot_tile_x4_streams(const uint8_t* const groups[kDotStreams], int32_t blocks, const int8_t* xq,
                                 int64_t x_stride, const float* xs, int64_t xs_stride, float* out) {
  LaneSums acc[kDotStreams][MR];
  for (int32_t b = 0; b < blocks; b += 2) {
#pragma GCC unroll 4
    for (int j = 0; j < kDotStreams; ++j) {
      x4_pair<T, MR>(groups[j] + (b / 2) * x4_pair_bytes<T>(), b, xq, x_stride, xs, xs_stride, acc[j]);
    }
  }
  for (int j = 0; j < kDotStreams; ++j) store_tile<MR>(acc[j], out + j * kCombos * MR, MR);
}

// run_dot_task on x4 rows (kQ4_1x4, kQ8_0x4): a tile is a group, whose rows are one contiguous
// run, and a step takes one group from each quarter of the task (dot_tile_x4_streams).
template <QuantType T>
inline void run_dot_task_x4(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  const int32_t n0 = static_cast<int32_t>(task * rows_per_task);  // a multiple of 4, as rows_per_task
  const int32_t groups = std::min(rows_per_task, a.n - n0) / kCombos;
  const int32_t blocks = a.k / 32;  // even
  const int64_t group_bytes = (blocks / 2) * x4_pair_bytes<T>();
  const uint8_t* first = a.weight + n0 / kCombos * group_bytes;
  thread_local std::vector<float> out_buffer;  // [m, rows_per_task] for quant_store_out
  out_buffer.resize(static_cast<size_t>(a.m) * rows_per_task);
  float* out_rows = out_buffer.data();
  float values[kDotStreams * kCombos * kXRowsPerPass];
  const float* spread = spread_pair_scales(x, a.m, blocks);
  const int64_t xs_stride = quant_x_group_floats(blocks);
  const int32_t quarter = (groups + kDotStreams - 1) / kDotStreams;
  for (int32_t c = 0; c < quarter; ++c) {
    int32_t step_groups[kDotStreams];  // stream j's group of this step, or -1
    const uint8_t* tile[kDotStreams];
    for (int j = 0; j < kDotStreams; ++j) {
      const int32_t g = j * quarter + c;
      step_groups[j] = g < groups ? g : -1;
      tile[j] = first + (g < groups ? g : c) * group_bytes;  // stream 0's group stands in
    }
    for (int64_t i0 = 0; i0 < a.m; i0 += kXRowsPerPass) {
      const int mr = static_cast<int>(std::min<int64_t>(kXRowsPerPass, a.m - i0));
      const int8_t* xq = x.q + i0 * x.q_stride;
      const float* xs = spread + i0 * xs_stride;
      switch (mr) {
        case 1: dot_tile_x4_streams<T, 1>(tile, blocks, xq, x.q_stride, xs, xs_stride, values); break;
        case 2: dot_tile_x4_streams<T, 2>(tile, blocks, xq, x.q_stride, xs, xs_stride, values); break;
        case 3: dot_tile_x4_streams<T, 3>(tile, blocks, xq, x.q_stride, xs, xs_stride, values); break;
        default: dot_tile_x4_streams<T, 4>(tile, blocks, xq, x.q_stride, xs, xs_stride, values); break;
      }
      for (int j = 0; j < kDotStreams; ++j) {
        if (step_groups[j] < 0) continue;
        for (int r = 0; r < kCombos; ++r) {
          const float* v = values + (j * kCombos + r) * mr;
          for (int i = 0; i < mr; ++i) out_rows[(i0 + i) * rows_per_task + kCombos * step_groups[j] + r] = v[i];
        }
      }
    }
  }
  for (int64_t i = 0; i < a.m; ++i) quant_store_out(a, i, n0, groups * kCombos, out_rows + i * rows_per_task);
}
constexpr bool kIntegerX4 = true;
#else
constexpr bool kIntegerX4 = false;  // the scalar loops read GGUF rows: x4 rows are unpacked first
#endif

inline void run_dot_task(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  switch (a.type) {
    case QuantType::kQ4_0: return run_dot_task_typed<QuantType::kQ4_0>(a, x, rows_per_task, task);
    case QuantType::kQ4_1: return run_dot_task_typed<QuantType::kQ4_1>(a, x, rows_per_task, task);
    case QuantType::kQ8_0: return run_dot_task_typed<QuantType::kQ8_0>(a, x, rows_per_task, task);
    case QuantType::kQ4_K: return run_dot_task_typed<QuantType::kQ4_K>(a, x, rows_per_task, task);
#if defined(__AVX2__)
    case QuantType::kQ4_1x4: return run_dot_task_x4<QuantType::kQ4_1x4>(a, x, rows_per_task, task);
    case QuantType::kQ8_0x4: return run_dot_task_x4<QuantType::kQ8_0x4>(a, x, rows_per_task, task);
#endif
#if defined(VPAGE_QMM_X8)
    case QuantType::kQ4_1x8: return run_dot_task_x8<QuantType::kQ4_1x8>(a, x, rows_per_task, task);
    case QuantType::kQ8_0x8: return run_dot_task_x8<QuantType::kQ8_0x8>(a, x, rows_per_task, task);
#endif
    default: return;  // the dispatcher sends only the 32-value formats, Q4_K, (SIMD) x4 and (VNNI) x8 types here
  }
}

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm
