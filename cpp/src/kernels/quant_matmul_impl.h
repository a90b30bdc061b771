// The quantized matmul task, compiled once per instruction set (quant_avx2.cpp,
// quant_avx512.cpp, quant_generic.cpp), each build in its own namespace.
//
// A task owns `rows_per_task` weight rows (output columns). For every chunk of x rows and
// every chunk of K it dequantizes its rows' blocks once into a float tile [rows, k_chunk]
// (L1/L2 sized), then an FMA micro-kernel computes kMr x kNr dot products at a time over
// the tile: kMr rows of x against kNr tile rows, k_chunk values long, reduced to scalars at
// the end of the chunk and added into a float accumulator [m_chunk, rows_per_task]. With
// m_chunk = m (decode) the weights are read and dequantized exactly once for all rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"
#include "quant_task.h"
#include "simd_vec.h"  // Vec, in namespace VPAGE_ISA_NAMESPACE (the parent of qmm)

namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm {  // qmm: no name clash with attention_impl.h's

#if defined(VPAGE_SIMD_AVX512)
constexpr int kMr = 4;  // 16 accumulators + 4 x vectors + 1 weight vector of 32 zmm
#else
constexpr int kMr = 3;  // 12 accumulators + 3 x vectors + 1 weight vector = 16 ymm
#endif
constexpr int kNr = 4;

// acc[i * acc_stride + j] += sum_k x[i * x_stride + k] * w[j * w_stride + k] for i < MR,
// j < kNr, k < kc (a multiple of 32, hence of kLanes).
template <int MR>
inline void micro_kernel(const float* x, int64_t x_stride, const float* w, int64_t w_stride, int32_t kc,
                         float* acc, int64_t acc_stride) {
  Vec s[MR][kNr];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < kNr; ++j) s[i][j] = zero();
  }
  for (int32_t k = 0; k < kc; k += kLanes) {
    Vec xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = load(x + i * x_stride + k);
    for (int j = 0; j < kNr; ++j) {
      const Vec wv = load(w + j * w_stride + k);
      for (int i = 0; i < MR; ++i) s[i][j] = fma(xv[i], wv, s[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < kNr; ++j) acc[i * acc_stride + j] += reduce_add(s[i][j]);
  }
}

// Rows [0, mc) of x against every kNr group of the tile [nt, kc].
inline void multiply_tile(const float* x, int64_t x_stride, int64_t mc, const float* tile, int32_t nt, int32_t kc,
                          float* acc) {
  int64_t i = 0;
  for (; i + kMr <= mc; i += kMr) {
    for (int32_t j = 0; j < nt; j += kNr) {
      micro_kernel<kMr>(x + i * x_stride, x_stride, tile + j * kc, kc, kc, acc + i * nt + j, nt);
    }
  }
  for (; i < mc; ++i) {  // fewer than kMr rows left
    for (int32_t j = 0; j < nt; j += kNr) {
      micro_kernel<1>(x + i * x_stride, x_stride, tile + j * kc, kc, kc, acc + i * nt + j, nt);
    }
  }
}

inline std::vector<float>& task_buffer(int which, size_t floats) {
  thread_local std::vector<float> buffers[2];
  if (buffers[which].size() < floats) buffers[which].resize(floats);
  return buffers[which];
}

inline void run_task(const QuantMatmulArgs& a, const float* x, int64_t x_stride, const QuantPlan& plan,
                     int64_t task) {
  const int32_t nt = plan.rows_per_task;
  const int32_t n0 = static_cast<int32_t>(task * nt);
  const int32_t rows = std::min(nt, a.n - n0);
  const int32_t block_values = quant_block_values(a.type);
  const int64_t row_bytes = static_cast<int64_t>(a.k / block_values) * quant_block_bytes(a.type);
  const int32_t kc_max = std::min(plan.k_chunk, a.k);
  float* tile = task_buffer(0, static_cast<size_t>(nt) * kc_max).data();
  float* acc = task_buffer(1, static_cast<size_t>(plan.m_chunk) * nt).data();
  for (int64_t m0 = 0; m0 < a.m; m0 += plan.m_chunk) {
    const int64_t mc = std::min(plan.m_chunk, a.m - m0);
    std::fill(acc, acc + mc * nt, 0.0f);
    for (int32_t k0 = 0; k0 < a.k; k0 += kc_max) {
      const int32_t kc = std::min(kc_max, a.k - k0);
      for (int32_t r = 0; r < rows; ++r) {
        dequantize_range(a.type, a.weight + (n0 + r) * row_bytes, k0 / block_values, kc, tile + r * kc);
      }
      std::fill(tile + rows * kc, tile + nt * kc, 0.0f);  // padding rows past n
      multiply_tile(x + m0 * x_stride + k0, x_stride, mc, tile, nt, kc, acc);
    }
    for (int64_t i = 0; i < mc; ++i) quant_store_out(a, m0 + i, n0, rows, acc + i * nt);
  }
}

inline void dequantize_rows(QuantType type, const uint8_t* weight, int64_t rows, int32_t k, float* out) {
  const int64_t row_bytes = static_cast<int64_t>(k / quant_block_values(type)) * quant_block_bytes(type);
  for (int64_t r = 0; r < rows; ++r) dequantize_range(type, weight + r * row_bytes, 0, k, out + r * k);
}

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm
