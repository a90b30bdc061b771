// The quantized matmul task, compiled once per instruction set (quant_avx2.cpp,
// quant_avx512.cpp, quant_generic.cpp), each build in its own namespace.
//
// A task owns `rows_per_task` weight rows (output columns). For every chunk of x rows and
// every chunk of K it dequantizes its rows' blocks once into a float tile (L1/L2 sized), then
// an FMA micro-kernel multiplies x with the tile into a float accumulator [m_chunk,
// rows_per_task]. Two tile layouts:
//  - decode (plan.k_major false, few x rows): tile [rows, k_chunk], row-major as dequantized;
//    the micro-kernel computes kMr x kNr dot products (vector partial sums reduced at the end
//    of the chunk). With m_chunk = m the weights are read and dequantized once for all rows.
//  - prefill (plan.k_major true): tile [k_chunk, rows] (each dequantized row scattered into a
//    column, paid once per m_chunk rows of x); the micro-kernel is the classic outer-product
//    GEMM kernel: per k, kPanelVecs tile vectors times kRows broadcast x values into
//    kRows x kPanelVecs vector accumulators (no reductions).
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

constexpr int kPanelVecs = 2;              // prefill micro-kernel: 2 vectors of tile columns
constexpr int kPanel = kPanelVecs * kLanes;  // 16 (AVX2, generic) or 32 (AVX-512) weight rows
constexpr int kRows = 6;                     // x rows: 12 accumulators + 2 tile vectors + 1 broadcast

// acc[i * acc_stride + c] += sum_k x[i * x_stride + k] * tile[k * tile_stride + c] for i < MR,
// c < kPanel, k < kc.
template <int MR>
inline void panel_kernel(const float* x, int64_t x_stride, const float* tile, int32_t tile_stride, int32_t kc,
                         float* acc, int64_t acc_stride) {
  Vec c[MR][kPanelVecs];
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < kPanelVecs; ++v) c[i][v] = load(acc + i * acc_stride + v * kLanes);
  }
  for (int32_t k = 0; k < kc; ++k) {
    const float* t = tile + static_cast<int64_t>(k) * tile_stride;
    Vec b[kPanelVecs];
    for (int v = 0; v < kPanelVecs; ++v) b[v] = load(t + v * kLanes);
    for (int i = 0; i < MR; ++i) {
      const Vec a = set1(x[i * x_stride + k]);
      for (int v = 0; v < kPanelVecs; ++v) c[i][v] = fma(a, b[v], c[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < kPanelVecs; ++v) store(acc + i * acc_stride + v * kLanes, c[i][v]);
  }
}

template <int MR>
inline void multiply_panels(const float* x, int64_t x_stride, const float* tile, int32_t nt, int32_t kc,
                            float* acc) {
  for (int32_t j = 0; j < nt; j += kPanel) panel_kernel<MR>(x, x_stride, tile + j, nt, kc, acc + j, nt);
}

// Rows [0, mc) of x against the k-major tile [kc, nt].
inline void multiply_k_major_tile(const float* x, int64_t x_stride, int64_t mc, const float* tile, int32_t nt,
                                  int32_t kc, float* acc) {
  int64_t i = 0;
  for (; i + kRows <= mc; i += kRows) multiply_panels<kRows>(x + i * x_stride, x_stride, tile, nt, kc, acc + i * nt);
  const float* xr = x + i * x_stride;
  float* ar = acc + i * nt;
  switch (mc - i) {  // fewer than kRows rows left
    case 5: multiply_panels<5>(xr, x_stride, tile, nt, kc, ar); break;
    case 4: multiply_panels<4>(xr, x_stride, tile, nt, kc, ar); break;
    case 3: multiply_panels<3>(xr, x_stride, tile, nt, kc, ar); break;
    case 2: multiply_panels<2>(xr, x_stride, tile, nt, kc, ar); break;
    case 1: multiply_panels<1>(xr, x_stride, tile, nt, kc, ar); break;
    default: break;
  }
}

inline std::vector<float>& task_buffer(int which, size_t floats) {
  thread_local std::vector<float> buffers[3];
  if (buffers[which].size() < floats) buffers[which].resize(floats);
  return buffers[which];
}

// Dequantizes values [k0, k0 + kc) of the task's `rows` weight rows into the tile: [nt, kc]
// row-major, or [kc, nt] (k_major) through `row` [kc]; rows past `rows` are zero.
inline void fill_tile(const QuantMatmulArgs& a, const uint8_t* first_row, int64_t row_bytes, int32_t rows,
                      int32_t nt, int32_t k0, int32_t kc, bool k_major, float* tile, float* row) {
  const int64_t first_block = k0 / quant_block_values(a.type);
  if (!k_major) {
    for (int32_t r = 0; r < rows; ++r) dequantize_range(a.type, first_row + r * row_bytes, first_block, kc, tile + r * kc);
    std::fill(tile + rows * kc, tile + nt * kc, 0.0f);
    return;
  }
  for (int32_t r = 0; r < rows; ++r) {
    dequantize_range(a.type, first_row + r * row_bytes, first_block, kc, row);
    for (int32_t k = 0; k < kc; ++k) tile[static_cast<int64_t>(k) * nt + r] = row[k];
  }
  for (int32_t k = 0; k < kc && rows < nt; ++k) std::fill(tile + k * nt + rows, tile + (k + 1) * nt, 0.0f);
}

inline void run_task(const QuantMatmulArgs& a, const float* x, int64_t x_stride, const QuantPlan& plan,
                     int64_t task) {
  const int32_t nt = plan.rows_per_task;
  const int32_t n0 = static_cast<int32_t>(task * nt);
  const int32_t rows = std::min(nt, a.n - n0);
  const int64_t row_bytes = static_cast<int64_t>(a.k / quant_block_values(a.type)) * quant_block_bytes(a.type);
  const int32_t kc_max = std::min(plan.k_chunk, a.k);
  float* tile = task_buffer(0, static_cast<size_t>(nt) * kc_max).data();
  float* acc = task_buffer(1, static_cast<size_t>(plan.m_chunk) * nt).data();
  float* row = task_buffer(2, static_cast<size_t>(kc_max)).data();
  for (int64_t m0 = 0; m0 < a.m; m0 += plan.m_chunk) {
    const int64_t mc = std::min(plan.m_chunk, a.m - m0);
    std::fill(acc, acc + mc * nt, 0.0f);
    for (int32_t k0 = 0; k0 < a.k; k0 += kc_max) {
      const int32_t kc = std::min(kc_max, a.k - k0);
      fill_tile(a, a.weight + n0 * row_bytes, row_bytes, rows, nt, k0, kc, plan.k_major, tile, row);
      if (plan.k_major) {
        multiply_k_major_tile(x + m0 * x_stride + k0, x_stride, mc, tile, nt, kc, acc);
      } else {
        multiply_tile(x + m0 * x_stride + k0, x_stride, mc, tile, nt, kc, acc);
      }
    }
    for (int64_t i = 0; i < mc; ++i) quant_store_out(a, m0 + i, n0, rows, acc + i * nt);
  }
}

inline void dequantize_rows(QuantType type, const uint8_t* weight, int64_t rows, int32_t k, float* out) {
  const int64_t row_bytes = static_cast<int64_t>(k / quant_block_values(type)) * quant_block_bytes(type);
  for (int64_t r = 0; r < rows; ++r) dequantize_range(type, weight + r * row_bytes, 0, k, out + r * k);
}

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE::qmm
