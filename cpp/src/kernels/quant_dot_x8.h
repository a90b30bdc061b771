// The decode path's kernel for x8 rows (kQ4_1x8, kQ8_0x8), in the VNNI builds: lane r of
// every vector is row r of an eight-row group, and each 4-byte lane of a weight vector holds 4
// bytes of its row that meet the same 4 bytes of x, which vpdpbusd takes broadcast. A block's
// integer sums for the eight rows are then 8 vpdpbusd and need no reduction across lanes,
// where the x4 tiles spend about as many uops again on shuffles and adds that gather each
// (row, x row) sum into one lane. Compiled once per instruction set like quant_dot_impl.h.
//
// The lane arithmetic is the other integer kernels' (quant_dot_impl.h), per (weight row, x row):
//   scaled = fma(d_w * d_x, I, scaled); offset = fma(o_w, o_x, offset)   (Q4_1: o = m_w, s_x)
// block by block in order, the even blocks' chains apart from the odd blocks' (there lanes 0-3
// and 4-7 of one vector, here two vectors), and the result is (scaled + offset) of the even
// chains plus the same of the odd ones: bitwise the file rows' results on every path.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_dot_impl.h"

namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm {

// The AVX-512 VNNI build (and its emulation in tests/cpp/test_quant_vnni.cpp). Elsewhere x8 rows
// are unpacked to the file's rows: without vpdpbusd the kernel has no speed of its own, and with
// AVX-VNNI's 16 registers (not measured) the passes of 8 x rows would spill.
#if defined(VPAGE_QMM_DOT4) && (defined(__AVX512VL__) || defined(VPAGE_EMULATE_VNNI))
#define VPAGE_QMM_X8 1
constexpr bool kIntegerX8 = true;

constexpr int kX8MaxRows = 8;                // x rows per pass over a step's groups
// How far ahead in its stream a group is prefetched (Zen 4, SmolLM2-1.7B's Q4_1 matrices from
// DRAM at one x row: 512 B 31.7-34.4 GB/s, 1 KiB 26.1-32.1, 2 KiB 29.9; the host drifts ~5%).
constexpr int64_t kX8PrefetchBytes = 512;

// Groups read side by side, one from each part of a task: more keep more DRAM reads in flight
// (what one x row needs), fewer leave registers for more x rows (2 accumulators per x row and
// group, 8 weight vectors, of AVX-512's 32 registers).
constexpr int x8_streams(int max_rows) { return max_rows <= 2 ? 4 : max_rows <= 4 ? 2 : 1; }

// add_dot4 of u8 and the 4 signed bytes at x in every lane. AVX-512 takes them broadcast inside
// vpdpbusd ({1to8}), which GCC does not fold a _mm256_set1_epi32 of a load into; a separate
// vpbroadcastd per vpdpbusd made the kernel 1.3x slower (Zen 4, 8 x rows).
inline __m256i add_dot4_broadcast(__m256i acc, __m256i u8, const int8_t* x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  __asm__("vpdpbusd %1%{1to8%}, %2, %0" : "+v"(acc) : "m"(*reinterpret_cast<const int32_t*>(x)), "v"(u8));
  return acc;
#else
  int32_t v;
  std::memcpy(&v, x, 4);
  return add_dot4(acc, u8, _mm256_set1_epi32(v));
#endif
}

// Block b's integer sums for the eight rows: w[j] (j < 4) meets x values 4j .. 4j + 3 and w[4 + j]
// values 16 + 4j .. 19 + 4j; xb: the block's bytes in QuantizedX::q (pair order: values 0-15
// at xb, 16-31 at xb + 32). `hi` starts the second chain (Q8_0x8: -128 * sum of x's block, as
// its quants carry +128); two chains so that 8 dependent vpdpbusd do not wait on each other.
inline __m256i x8_block_sums(const __m256i w[8], const int8_t* xb, __m256i hi) {
  __m256i lo = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    lo = add_dot4_broadcast(lo, w[j], xb + 4 * j);
    hi = add_dot4_broadcast(hi, w[4 + j], xb + 32 + 4 * j);
  }
  return _mm256_add_epi32(lo, hi);
}

// x rows [0, MR) against all blocks of S groups (groups[s]): row i's results for group s's rows
// 0-7 into out[s] + i * out_stride (out[s] null: none). xq: row 0's bytes (x_stride apart); xd,
// xs, sums: row 0's block scales, offsets and sums of q ([m, blocks]; sums: Q8_0x8's correction).
template <QuantType T, int MR, int S>
inline void x8_tile(const uint8_t* const groups[S], int32_t blocks, const int8_t* xq, int64_t x_stride,
                    const float* xd, const float* xs, const int32_t* sums, float* const out[S], int64_t out_stride) {
  constexpr int64_t kBytes = quant_x8_block_bytes(T);
  // Q4_1x8's offset chains: beside the scaled ones while registers allow (a second pass over
  // the groups' headers, when they no longer sit in L1, slowed one x row from DRAM by 1.2x).
  constexpr bool kInlineOffsets = T == QuantType::kQ4_1x8 && S * MR <= 4;
  __m256 scaled[S][MR][2], offset[S][MR][2];  // [.][.][block parity]
  for (int s = 0; s < S; ++s) {
    for (int i = 0; i < MR; ++i) {
      for (int h = 0; h < 2; ++h) scaled[s][i][h] = offset[s][i][h] = _mm256_setzero_ps();
    }
  }
  auto block = [&](auto odd, int32_t b) {
    constexpr int h = decltype(odd)::value ? 1 : 0;
    const int64_t x_at = (b / 2) * 64 + (b % 2) * 16;
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const uint8_t* g = groups[s] + b * kBytes;
      for (int64_t line = 0; line < kBytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(g + kX8PrefetchBytes + line), _MM_HINT_T0);
      }
      const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g)));
      if constexpr (kInlineOffsets) {
        const __m256 m_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 16)));
        for (int i = 0; i < MR; ++i) {
          offset[s][i][h] = _mm256_fmadd_ps(m_w, _mm256_set1_ps(xs[i * blocks + b]), offset[s][i][h]);
        }
      }
      __m256i w[8];
      if constexpr (T == QuantType::kQ8_0x8) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 16 + 32 * j));
      } else {
        const __m256i mask = _mm256_set1_epi8(15);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + 32 + 32 * j));
          w[j] = _mm256_and_si256(raw, mask);
          w[4 + j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256i hi = T == QuantType::kQ8_0x8 ? _mm256_set1_epi32(-128 * sums[i * blocks + b])
                                                   : _mm256_setzero_si256();
        const __m256i sums = x8_block_sums(w, xq + i * x_stride + x_at, hi);
        scaled[s][i][h] = _mm256_fmadd_ps(_mm256_mul_ps(d_w, _mm256_set1_ps(xd[i * blocks + b])),
                                          _mm256_cvtepi32_ps(sums), scaled[s][i][h]);
      }
    }
  };
  auto offsets = [&](auto odd, int32_t b) {  // Q4_1x8: m_w * s_x
    constexpr int h = decltype(odd)::value ? 1 : 0;
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const __m128i m_half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(groups[s] + b * kBytes + 16));
      const __m256 m_w = _mm256_cvtph_ps(m_half);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        offset[s][i][h] = _mm256_fmadd_ps(m_w, _mm256_set1_ps(xs[i * blocks + b]), offset[s][i][h]);
      }
    }
  };
  int32_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    block(std::false_type{}, b);
    block(std::true_type{}, b + 1);
  }
  if (b < blocks) block(std::false_type{}, b);
  if constexpr (T == QuantType::kQ4_1x8 && !kInlineOffsets) {
    for (b = 0; b + 2 <= blocks; b += 2) {
      offsets(std::false_type{}, b);
      offsets(std::true_type{}, b + 1);
    }
    if (b < blocks) offsets(std::false_type{}, b);
  }
  for (int s = 0; s < S; ++s) {
    if (out[s] == nullptr) continue;
    for (int i = 0; i < MR; ++i) {
      _mm256_storeu_ps(out[s] + i * out_stride, _mm256_add_ps(_mm256_add_ps(scaled[s][i][0], offset[s][i][0]),
                                                              _mm256_add_ps(scaled[s][i][1], offset[s][i][1])));
    }
  }
}

// One pass of mr x rows (at most the task's largest pass, for which S was chosen).
template <QuantType T, int S>
inline void x8_pass(int mr, const uint8_t* const groups[S], int32_t blocks, const int8_t* xq, int64_t x_stride,
                    const float* xd, const float* xs, const int32_t* sums, float* const out[S], int64_t out_stride) {
#define VPAGE_X8_CASE(R) \
  case R: return x8_tile<T, R, S>(groups, blocks, xq, x_stride, xd, xs, sums, out, out_stride);
  if constexpr (S == 4) {
    switch (mr) { VPAGE_X8_CASE(1) default: VPAGE_X8_CASE(2) }
  } else if constexpr (S == 2) {
    switch (mr) { VPAGE_X8_CASE(1) VPAGE_X8_CASE(2) VPAGE_X8_CASE(3) default: VPAGE_X8_CASE(4) }
  } else {
    switch (mr) {
      VPAGE_X8_CASE(1) VPAGE_X8_CASE(2) VPAGE_X8_CASE(3) VPAGE_X8_CASE(4) VPAGE_X8_CASE(5) VPAGE_X8_CASE(6)
      VPAGE_X8_CASE(7) default: VPAGE_X8_CASE(8)
    }
  }
#undef VPAGE_X8_CASE
}

// x rows per chunk: a task's weights (in L2 when they fit) meet a chunk of x rows at a time.
constexpr int64_t kX8ChunkRows = 64;

// Rows [i0, i0 + mc) of x against a task's groups: the groups in S parts read side by side,
// step by step; each step's groups meet every x row of the chunk (passes of at most
// kX8MaxRows, as even as they go) while in L1.
template <QuantType T, int S>
inline void x8_chunk(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task, int64_t i0,
                     int64_t mc, int passes) {
  const int32_t n0 = static_cast<int32_t>(task * rows_per_task);  // a multiple of 8, as rows_per_task
  const int32_t groups = std::min(rows_per_task, a.n - n0) / 8;
  const int32_t blocks = a.k / 32;
  const int64_t group_bytes = blocks * quant_x8_block_bytes(T);
  const uint8_t* first = a.weight + n0 / 8 * group_bytes;
  // float32 results go straight into out; 16-bit ones through out_rows and quant_store_out.
  const bool direct = a.dtype == DType::kFloat32;
  thread_local std::vector<float> out_rows;  // [mc, rows_per_task]
  if (!direct) out_rows.resize(static_cast<size_t>(mc) * rows_per_task);
  float* out0 = direct ? static_cast<float*>(a.out) + i0 * a.out_stride + n0 : out_rows.data();
  const int64_t out_stride = direct ? a.out_stride : rows_per_task;
  const int32_t quarter = (groups + S - 1) / S;
  for (int32_t c = 0; c < quarter; ++c) {
    const uint8_t* tile[S];
    float* out[S];
    for (int s = 0; s < S; ++s) {
      const int32_t g = s * quarter + c;
      tile[s] = first + (g < groups ? g : c) * group_bytes;  // stream 0's group stands in
      out[s] = g < groups ? out0 + 8 * g : nullptr;
    }
    for (int p = 0, i = 0; p < passes; ++p) {
      const int mr = static_cast<int>((mc - i) / (passes - p));  // the larger passes last
      float* pass_out[S];
      for (int s = 0; s < S; ++s) pass_out[s] = out[s] == nullptr ? nullptr : out[s] + i * out_stride;
      x8_pass<T, S>(mr, tile, blocks, x.q + (i0 + i) * x.q_stride, x.q_stride, x.d + (i0 + i) * blocks,
                    x.s + (i0 + i) * blocks, x.sums + (i0 + i) * blocks, pass_out, out_stride);
      i += mr;
    }
  }
  if (!direct) {
    for (int64_t i = 0; i < mc; ++i) quant_store_out(a, i0 + i, n0, groups * 8, out_rows.data() + i * rows_per_task);
  }
}

// run_dot_task on x8 rows, any number of x rows (the VNNI builds take every x8 matmul of the
// integer paths here).
template <QuantType T>
inline void run_dot_task_x8(const QuantMatmulArgs& a, const QuantizedX& x, int32_t rows_per_task, int64_t task) {
  for (int64_t i0 = 0; i0 < a.m; i0 += kX8ChunkRows) {
    const int64_t mc = std::min(kX8ChunkRows, a.m - i0);
    const int passes = static_cast<int>((mc + kX8MaxRows - 1) / kX8MaxRows);
    switch (x8_streams(static_cast<int>((mc + passes - 1) / passes))) {
      case 4: x8_chunk<T, 4>(a, x, rows_per_task, task, i0, mc, passes); break;
      case 2: x8_chunk<T, 2>(a, x, rows_per_task, task, i0, mc, passes); break;
      default: x8_chunk<T, 1>(a, x, rows_per_task, task, i0, mc, passes); break;
    }
  }
}
#else
constexpr bool kIntegerX8 = false;
#endif

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm
