// The dense matmul task for bfloat16 activations times bfloat16 weights on CPUs with
// AVX512-BF16 (dense_avx512bf16.cpp): `vdpbf16ps` multiplies pairs of bfloat16 values and adds
// both products to a float32 lane, twice the work of a float32 FMA per instruction.
//
// Per panel chunk of 256 values of k, the packed [k, 32] bfloat16 rows are interleaved by pairs
// of k into a tile [kc / 2][32 columns][2] (two zmm per pair, columns in lane_column's order),
// once for the task's block of x rows (up to 32 rows, in registers as the pairs are used);
// the micro-kernel then broadcasts each x row's pair (x[k], x[k + 1]) as one 32-bit value and
// runs kRows x 2 accumulators over the pairs. An odd last k pairs with a zero. The
// accumulators go to the same [rows, 32] buffer as the float kernel's between chunks, so a
// row's result does not depend on its batch. Finished rows go back to column order by two
// permutes and, for whole panels without bias, from the last chunk's accumulators straight to
// the output (a dense_store_out call per row and panel was ~12% of the bfloat16 throughput
// trace on Zen 4: RESULTS-vllm-cpu.md).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dense_task.h"
#include "row_blocks.h"
#include "simd_vec.h"  // Vec, BF16 and the ISA's bfloat16 store

#if !defined(__AVX512BF16__)
#error "dense_bf16_dot.h needs -mavx512bf16"
#endif

namespace vpage::cpu::avx512bf16 {

constexpr int kDotRows = 8;          // 16 accumulators + 2 tile vectors + 1 broadcast
constexpr int32_t kDotKChunk = 256;  // tile: 128 pairs x 32 columns x 4 bytes = 16 KiB

// Pair p of the packed rows w [kc, 32]: (w[2p][c], w[2p + 1][c]) for every column c (a missing
// row 2p + 1 of an odd kc is zeros), interleaved by unpacking within 128-bit lanes, so the
// columns come in lane_column's order: lo holds 0-3, 8-11, 16-19, 24-27; hi the others.
VPAGE_ALWAYS_INLINE void row_pair(const uint16_t* w, int32_t kc, int32_t p, __m512i& lo, __m512i& hi) {
  const __m512i r0 = _mm512_loadu_si512(w + static_cast<int64_t>(2 * p) * kDensePanelRows);
  const __m512i r1 = 2 * p + 1 < kc ? _mm512_loadu_si512(w + static_cast<int64_t>(2 * p + 1) * kDensePanelRows)
                                    : _mm512_setzero_si512();
  lo = _mm512_unpacklo_epi16(r0, r1);
  hi = _mm512_unpackhi_epi16(r0, r1);
}

// tile[2 p], tile[2 p + 1] = row_pair p of w [kc, 32], for every pair.
inline void interleave_pairs(const uint16_t* w, int32_t kc, __m512i* tile) {
  for (int32_t p = 0; 2 * p < kc; ++p) row_pair(w, kc, p, tile[2 * p], tile[2 * p + 1]);
}

// Where dot_rows takes pair p's weight vectors: a tile interleaved once for the task's block
// of rows (every row block reads it) ...
struct TilePairs {
  const __m512i* tile;
  VPAGE_ALWAYS_INLINE void operator()(int32_t p, __m512i& lo, __m512i& hi) const {
    lo = tile[2 * p];
    hi = tile[2 * p + 1];
  }
};

// ... or, up to kRowPairsRows rows (decode batches, single streams), the packed rows
// themselves, paired in registers by each row block as it uses them: the tile's store and
// reload cost more there than the repeated unpacks (Zen 4, one forward's matmuls of the
// default model: 12 rows 1.17x, 16 1.09x, 32 1.07x faster than through the tile; 40-1024
// rows level, where the tile stays, for CPUs whose shuffles share a port with the
// multiply-adds). Each pair also prefetches the rows kAheadPairs pairs on, past the chunk's
// end into the next one, as the float kernel's first pass does (3 KiB ahead).
constexpr int64_t kRowPairsRows = 4 * kDotRows;
constexpr int32_t kAheadPairs = 24;
struct RowPairs {
  const uint16_t* w;
  int32_t kc;
  VPAGE_ALWAYS_INLINE void operator()(int32_t p, __m512i& lo, __m512i& hi) const {
    const char* ahead = reinterpret_cast<const char*>(w + static_cast<int64_t>(2 * (p + kAheadPairs)) * kDensePanelRows);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    row_pair(w, kc, p, lo, hi);
  }
};

// The output column of accumulator lane q (acc [rows, 32] rows are in this order).
constexpr int32_t lane_column(int32_t q) { return 8 * (q % 16 / 4) + 4 * (q / 16) + q % 4; }

// The packed chunk that a task interleaves next ([kc, 32] bfloat16 rows), fetched into L2
// while it works on the current one: the interleave is the first read of each chunk, and
// reading it from DRAM there was ~11% of the task's time on the bfloat16 throughput trace
// (Zen 4).
struct NextChunk {
  const uint16_t* rows = nullptr;  // nullptr: the task has no next chunk
  int32_t pairs = 0;               // ceil(kc / 2): one pair of rows is 128 bytes, two lines
};

// The accumulator lane of each output column (the inverse of lane_column).
alignas(64) inline constexpr int32_t kColumnLane[kDensePanelRows] = {
    0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
constexpr bool column_lanes_invert_lane_column() {
  for (int32_t c = 0; c < kDensePanelRows; ++c) {
    if (lane_column(kColumnLane[c]) != c) return false;
  }
  return true;
}
static_assert(column_lanes_invert_lane_column(), "kColumnLane must invert lane_column");

// A row's accumulators h0, h1 (lanes in lane_column's order) as columns 0-15 (lo) and 16-31 (hi).
VPAGE_ALWAYS_INLINE void to_column_order(__m512 h0, __m512 h1, __m512& lo, __m512& hi) {
  lo = _mm512_permutex2var_ps(h0, _mm512_load_si512(kColumnLane), h1);
  hi = _mm512_permutex2var_ps(h0, _mm512_load_si512(kColumnLane + 16), h1);
}

// acc[i * 32 + c] (+)= sum_k x[i * x_stride + k] * w[k][c] for i < MR over the kc values of k
// whose pairs `pairs` gives (TilePairs, RowPairs: the same vectors, so the same bits); `first`:
// the accumulators start at zero. With direct.data set (a chunk that ends k, of a whole
// panel without bias) the rows go in column order straight to the output (bfloat16, or
// float32 for a model's logits) instead of to acc, so that the stores leave while the next
// rows compute. kPrefetch: fetch `next` too, spread over the pair steps (a pair of its rows per step
// when it is no longer than this chunk).
template <int MR, bool kPrefetch, typename Pairs>
inline void dot_rows(const uint16_t* x, int64_t x_stride, const Pairs& pairs, int32_t kc, float* acc, bool first,
                     const NextChunk& next, const OutRows& direct) {
  __m512 c[MR][2];
  for (int i = 0; i < MR; ++i) {
    for (int h = 0; h < 2; ++h) {
      c[i][h] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + i * kDensePanelRows + 16 * h);
    }
  }
  // One pair of k: x_pair(i) is row i's (x[k], x[k + 1]) as one 32-bit value.
  const int32_t steps = (kc + 1) / 2;
  const auto step = [&](int32_t p, auto x_pair) {
    if constexpr (kPrefetch) {
      for (int32_t q = p; q < next.pairs; q += steps) {
        const char* line = reinterpret_cast<const char*>(next.rows + static_cast<int64_t>(2 * q) * kDensePanelRows);
        _mm_prefetch(line, _MM_HINT_T1);
        _mm_prefetch(line + 64, _MM_HINT_T1);
      }
    }
    __m512i lo, hi;
    pairs(p, lo, hi);
    const __m512bh b0 = reinterpret_cast<__m512bh>(lo);
    const __m512bh b1 = reinterpret_cast<__m512bh>(hi);
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x_pair(i)));
      c[i][0] = _mm512_dpbf16_ps(c[i][0], a, b0);
      c[i][1] = _mm512_dpbf16_ps(c[i][1], a, b1);
    }
  };
  const int32_t full = kc / 2;
  for (int32_t p = 0; p < full; ++p) {
    step(p, [&](int i) {
      int32_t pair;
      std::memcpy(&pair, x + i * x_stride + 2 * p, sizeof(pair));
      return pair;
    });
  }
  if (kc % 2) step(full, [&](int i) { return static_cast<int32_t>(x[i * x_stride + kc - 1]); });
  if (direct.data != nullptr) {
    for (int i = 0; i < MR; ++i) {
      __m512 lo, hi;
      to_column_order(c[i][0], c[i][1], lo, hi);
      direct.store_vec(i, 0, Vec{lo});
      direct.store_vec(i, kLanes, Vec{hi});
    }
    return;
  }
  for (int i = 0; i < MR; ++i) {
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(acc + i * kDensePanelRows + 16 * h, c[i][h]);
  }
}

// All mc rows over the chunk's pairs; the first row block fetches `next`.
template <typename Pairs>
inline void dot_chunk(const uint16_t* x, int64_t x_stride, int64_t mc, const Pairs& pairs, int32_t kc, float* acc,
                      bool first, const NextChunk& next, const OutRows& direct) {
  for_row_blocks<kDotRows>(mc, [&](auto rows, int64_t i) {
    constexpr int kRowsHere = decltype(rows)::value;
    float* rows_acc = acc + i * kDensePanelRows;
    const OutRows rows_out = direct.data != nullptr ? direct.from(i, 0) : direct;
    if (i == 0 && next.rows != nullptr) {
      dot_rows<kRowsHere, true>(x + i * x_stride, x_stride, pairs, kc, rows_acc, first, next, rows_out);
    } else {
      dot_rows<kRowsHere, false>(x + i * x_stride, x_stride, pairs, kc, rows_acc, first, next, rows_out);
    }
  });
}

// Stores the task's finished rows of panel columns [col0, col0 + cols) from acc [mc, 32]
// through dense_store_out (a panel with bias, or the last, partial one).
inline void store_panel(const DenseMatmulArgs& a, const float* acc, int64_t m0, int64_t mc, int32_t col0,
                        int32_t cols) {
  for (int64_t i = 0; i < mc; ++i) {
    __m512 lo, hi;
    const float* lanes = acc + i * kDensePanelRows;
    to_column_order(_mm512_loadu_ps(lanes), _mm512_loadu_ps(lanes + 16), lo, hi);
    alignas(64) float row[kDensePanelRows];
    _mm512_store_ps(row, lo);
    _mm512_store_ps(row + 16, hi);
    dense_store_out(a, m0 + i, col0, cols, row);
  }
}

// Task `task` of `plan` with x the bfloat16 rows args.x (row stride args.x_stride).
inline void run_bf16_dot_task(const DenseMatmulArgs& a, const DensePlan& plan, int64_t task) {
  thread_local std::vector<float> buffer;
  alignas(64) thread_local __m512i tile[kDotKChunk];  // kDotKChunk / 2 pairs x 2 vectors
  const int64_t m0 = task / plan.panel_groups * plan.m_block;
  const int64_t mc = std::min(plan.m_block, a.m - m0);
  const int64_t p0 = task % plan.panel_groups * plan.panels_per_task;
  const int64_t p1 = std::min<int64_t>(p0 + plan.panels_per_task, plan.num_panels);
  float* acc = aligned_scratch(buffer, static_cast<size_t>(mc) * kDensePanelRows);
  const uint16_t* x = static_cast<const uint16_t*>(a.x) + m0 * a.x_stride;
  const uint16_t* weight = static_cast<const uint16_t*>(a.weight);
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* panel = weight + p * a.k * kDensePanelRows;
    const int32_t col0 = static_cast<int32_t>(p * kDensePanelRows);
    const int32_t cols = std::min(kDensePanelRows, a.n - col0);
    const OutRows out{static_cast<char*>(a.out), a.out_stride * (a.float32_out ? 4 : 2), !a.float32_out};
    const OutRows direct = a.bias == nullptr && cols == kDensePanelRows ? out.from(m0, col0) : OutRows{};
    for (int32_t k0 = 0; k0 < a.k; k0 += kDotKChunk) {
      const int32_t kc = std::min(kDotKChunk, a.k - k0);
      const uint16_t* rows = panel + static_cast<int64_t>(k0) * kDensePanelRows;
      const OutRows chunk_out = k0 + kc == a.k ? direct : OutRows{};
      if (mc <= kRowPairsRows) {
        dot_chunk(x + k0, a.x_stride, mc, RowPairs{rows, kc}, kc, acc, k0 == 0, NextChunk{}, chunk_out);
        continue;
      }
      interleave_pairs(rows, kc, tile);
      const int32_t next_kc = next_chunk_values(a.k, k0, kc, kDotKChunk, p + 1 == p1);
      const NextChunk next =
          next_kc > 0 ? NextChunk{rows + static_cast<int64_t>(kc) * kDensePanelRows, (next_kc + 1) / 2} : NextChunk{};
      dot_chunk(x + k0, a.x_stride, mc, TilePairs{tile}, kc, acc, k0 == 0, next, chunk_out);
    }
    if (direct.data == nullptr) store_panel(a, acc, m0, mc, col0, cols);
  }
}

}  // namespace vpage::cpu::avx512bf16
