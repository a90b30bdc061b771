// The dense (packed float weight) matmul task, compiled once per instruction set
// (dense_avx2.cpp, dense_avx512.cpp, dense_generic.cpp), each build in its own namespace.
//
// A task owns a block of x rows and a run of weight panels (dense_matmul.h: panel p holds
// weight rows [32 p, 32 p + 32) as [k, 32]). For each panel, 256 values of k at a time, the
// micro-kernel multiplies kRows x rows with one sub-panel of kSub columns: per k, kSubVecs
// weight vectors (widened from 16 bits when the weights are) times kRows broadcast x values
// into kRows x kSubVecs float32 accumulators (an outer product, no reductions). The
// accumulators go to a [rows, 32] buffer between k chunks (and from the last chunk to the
// output), so every output is a chain of FMAs in k order whatever the row's place in the
// batch. With many rows a 16-bit panel chunk is widened to float32 once (kWidenRows).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "dense_task.h"
#include "row_blocks.h"
#include "simd_vec.h"  // Vec, F16, BF16, in namespace VPAGE_ISA_NAMESPACE (the parent of dense)

namespace vpage::cpu::VPAGE_ISA_NAMESPACE::dense {  // dense: no name clash with the other kernels

#if defined(VPAGE_SIMD_AVX512)
constexpr int kRows = 8;  // 16 accumulators + 2 weight vectors + 1 broadcast of 32 zmm
#else
constexpr int kRows = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast = 15 of 16 ymm
#endif
constexpr int kSubVecs = 2;
constexpr int kSub = kSubVecs * kLanes;  // columns per micro-kernel call: 32 (AVX-512) or 16
static_assert(kDensePanelRows % kSub == 0, "a panel is whole sub-panels");
constexpr int32_t kKChunk = 256;         // panel chunk: 256 x 32 floats = 32 KiB
constexpr int64_t kPrefetchRows = 24;    // ~ DRAM latency / the first rows' time per k
// With one x row the hardware prefetchers keep up alone (software prefetches slowed it ~20%).
constexpr int64_t kPrefetchFromRows = 2;
// From this many x rows a 16-bit panel chunk is widened once into a float32 tile that every
// row then reads, instead of in registers for every kRows rows (the same values and FMAs, so
// the same bits either way).
constexpr int64_t kWidenRows = 4 * kRows;

// What a micro-kernel call fetches besides its own work (sub_panel).
enum class Fetch {
  kNone,
  kRowsAhead,  // the packed row ahead[k * 32] per k, into L1
  kNextChunk,  // lines of the task's next chunk, into L2 (NextChunkLines)
};

// The task's next panel chunk, fetched into L2 a line every `every` values of k by the
// passes over the current chunk after its first, so that DRAM streams while those passes
// compute. Otherwise the chunk's whole first read falls in one pass (its first rows), which
// asks several times one core's DRAM bandwidth of it, and the later passes leave DRAM idle
// (8-48 rows: up to 15% of those matmuls' time with the AVX2 build).
struct NextChunkLines {
  const char* at = nullptr;  // the next line to fetch
  const char* end = nullptr;
  int32_t every = 1;
};

// Where a micro-kernel's accumulators start and end: loaded from acc [rows, 32] (zero when
// `first`), stored to out: acc itself, or on a chunk that ends k (of a whole panel without
// bias) the output rows, float32 or bfloat16, so that the stores and their write misses leave while the next rows
// compute instead of in one burst per panel (Zen 4, one forward's matmuls of the default
// model: 48-256 rows 1.03-1.06x, the AVX2 build 16-32 rows 1.05-1.2x; RESULTS-vllm-cpu.md).
struct AccRows {
  float* acc;
  OutRows out;
  bool first;

  AccRows at(int64_t row, int col) const { return {acc + row * kDensePanelRows + col, out.from(row, col), first}; }
};

// out row i, column c = (first ? 0 : acc[i * 32 + c]) + sum_k x[i * x_stride + k] * w[k * 32 + c]
// for i < MR and the NV vectors' columns c (`rows` gives acc, out and first).
// kFetch kRowsAhead is for the first pass over a chunk: ahead is the chunk's row
// kPrefetchRows, whose weights come from DRAM or L2 (with a few rows the hardware prefetchers
// fall behind: measured on a Zen 1 EPYC, one thread, the default model's matmuls took 2x as
// long at 6 rows as at 4), or for a widened chunk the next 16-bit chunk. kNextChunk takes its
// lines from `next` and advances it.
// NV: weight vectors per k (kSubVecs, or a whole panel row for up to three x rows).
template <int MR, Fetch kFetch, int NV = kSubVecs, typename W, typename A>
inline void sub_panel(const float* x, int64_t x_stride, const W* w, int32_t kc, const AccRows& rows,
                      const A* ahead, NextChunkLines* next) {
  Vec c[MR][NV];
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v) c[i][v] = rows.first ? zero() : load(rows.acc + i * kDensePanelRows + v * kLanes);
  }
  const char* line = kFetch == Fetch::kNextChunk ? next->at : nullptr;
  const char* const line_end = kFetch == Fetch::kNextChunk ? next->end : nullptr;
  const int32_t every = kFetch == Fetch::kNextChunk ? next->every : 1;
  int32_t line_due = 0;  // the k that fetches `line`
  for (int32_t k = 0; k < kc; ++k) {
    const W* wk = w + static_cast<int64_t>(k) * kDensePanelRows;
    if constexpr (kFetch == Fetch::kRowsAhead) {
      const char* row = reinterpret_cast<const char*>(ahead + static_cast<int64_t>(k) * kDensePanelRows);
      for (size_t byte = 0; byte < kDensePanelRows * sizeof(A); byte += 64) __builtin_prefetch(row + byte, 0, 3);
    }
    if constexpr (kFetch == Fetch::kNextChunk) {
      if (k == line_due && line < line_end) {
        __builtin_prefetch(line, 0, 2);
        line += 64;
        line_due += every;
      }
    }
    if constexpr (NV == kSubVecs) {
      Vec b[NV];
      for (int v = 0; v < NV; ++v) b[v] = load(wk + v * kLanes);
      for (int i = 0; i < MR; ++i) {
        const Vec a = set1(x[i * x_stride + k]);
        for (int v = 0; v < NV; ++v) c[i][v] = fma(a, b[v], c[i][v]);
      }
    } else {
      // A whole panel row: the x values first, then one weight vector at a time, so that
      // three rows fit the 16 registers (12 accumulators, 3 broadcasts, 1 weight vector).
      Vec a[MR];
      for (int i = 0; i < MR; ++i) a[i] = set1(x[i * x_stride + k]);
      for (int v = 0; v < NV; ++v) {
        const Vec b = load(wk + v * kLanes);
        for (int i = 0; i < MR; ++i) c[i][v] = fma(a[i], b, c[i][v]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v) rows.out.store_vec(i, v * kLanes, c[i][v]);
  }
  if constexpr (kFetch == Fetch::kNextChunk) next->at = line;
}

// sub_panel with the fetch chosen at run time: rows ahead when `ahead` is set, else the next
// chunk's lines when `next` is set.
template <int MR, int NV = kSubVecs, typename W, typename A>
inline void sub_panel_fetching(const float* x, int64_t x_stride, const W* w, int32_t kc, const AccRows& rows,
                               const A* ahead, NextChunkLines* next) {
  if (ahead != nullptr) return sub_panel<MR, Fetch::kRowsAhead, NV>(x, x_stride, w, kc, rows, ahead, next);
  if (next != nullptr) return sub_panel<MR, Fetch::kNextChunk, NV>(x, x_stride, w, kc, rows, ahead, next);
  sub_panel<MR, Fetch::kNone, NV>(x, x_stride, w, kc, rows, ahead, next);
}

// MR rows of x against a whole panel chunk (every sub-panel); the first sub-panel of the
// chunk's first rows prefetches from `ahead` (nullptr: nothing), the other sub-panels from
// `next` (nullptr: nothing).
template <int MR, typename W, typename A>
inline void panel_rows(const float* x, int64_t x_stride, const W* w, int32_t kc, const AccRows& rows,
                       const A* ahead, NextChunkLines* next) {
  if constexpr (MR <= 3) {
    // One to three x rows: the whole panel row per k (its accumulators and weights fit the
    // registers), so that the weights are read in one ordered pass.
    constexpr int kPanelVecs = kDensePanelRows / kLanes;
    return sub_panel_fetching<MR, kPanelVecs>(x, x_stride, w, kc, rows, ahead, next);
  }
  sub_panel_fetching<MR>(x, x_stride, w, kc, rows, ahead, next);
  for (int s = kSub; s < kDensePanelRows; s += kSub) {
    sub_panel_fetching<MR>(x, x_stride, w + s, kc, rows.at(0, s), static_cast<const A*>(nullptr), next);
  }
}

// Rows [0, mc) of x against a panel chunk; the last mc % kRows rows take a smaller kernel.
// From kPrefetchFromRows rows the first rows' pass prefetches from `ahead` (sub_panel) and
// the later passes fetch the next chunk's next_bytes from `next` (nullptr: none).
template <typename W, typename A>
inline void panel_chunk(const float* x, int64_t x_stride, int64_t mc, const W* w, int32_t kc, const AccRows& rows,
                        const A* ahead, const char* next = nullptr, int64_t next_bytes = 0) {
  if (mc < kPrefetchFromRows) ahead = nullptr;
  const bool by_threes = kSub < kDensePanelRows && mc <= 2 * kRows;
  const int64_t passes =
      by_threes ? (mc + 2) / 3 : (mc + kRows - 1) / kRows * (kDensePanelRows / kSub);  // micro-kernel calls
  NextChunkLines lines;
  NextChunkLines* fetch_next = nullptr;
  if (next != nullptr && ahead != nullptr && passes > 1) {
    const int64_t lines_per_pass = ((next_bytes + 63) / 64 + passes - 2) / (passes - 1);
    lines = {next, next + next_bytes, static_cast<int32_t>(std::max<int64_t>(1, kc / lines_per_pass))};
    fetch_next = &lines;
  }
  if (by_threes) {
    // Up to 12 rows (decode batches, speculative steps) go three at a time over whole panel rows:
    // each pass reads the chunk in order (the first from memory, the others from L1). The
    // first pass's FMAs hide under its wait for memory; the later passes' do not, so the
    // fewer passes the better (Zen 1, 5 rows: 41 -> 38 ms of matmuls per forward of the default
    // model; 8 rows: 53 -> 50).
    for_row_blocks<3>(mc, [&](auto mr, int64_t i) {
      panel_rows<decltype(mr)::value>(x + i * x_stride, x_stride, w, kc, rows.at(i, 0), i == 0 ? ahead : nullptr,
                                      i == 0 ? nullptr : fetch_next);
    });
    return;
  }
  for_row_blocks<kRows>(mc, [&](auto mr, int64_t i) {
    panel_rows<decltype(mr)::value>(x + i * x_stride, x_stride, w, kc, rows.at(i, 0), i == 0 ? ahead : nullptr,
                                    fetch_next);
  });
}

// dst [kc, 32] = the 16-bit panel chunk src [kc, 32] as float32.
template <typename W>
inline void widen_chunk(const W* src, int32_t kc, float* dst) {
  for (int64_t i = 0; i < static_cast<int64_t>(kc) * kDensePanelRows; i += kLanes) store(dst + i, load(src + i));
}

template <typename W>
inline void run_task_typed(const DenseMatmulArgs& a, const float* x, int64_t x_stride, const DensePlan& plan,
                           int64_t task) {
  thread_local std::vector<float> buffer, widened;
  const int64_t m0 = task / plan.panel_groups * plan.m_block;
  const int64_t mc = std::min(plan.m_block, a.m - m0);
  const int64_t p0 = task % plan.panel_groups * plan.panels_per_task;
  const int64_t p1 = std::min<int64_t>(p0 + plan.panels_per_task, plan.num_panels);
  float* acc = aligned_scratch(buffer, static_cast<size_t>(mc) * kDensePanelRows);
  constexpr bool kSixteenBit = !std::is_same_v<W, float>;
  const bool widen = kSixteenBit && mc >= kWidenRows;
  float* tile = widen ? aligned_scratch(widened, static_cast<size_t>(kKChunk) * kDensePanelRows) : nullptr;
  const W* weight = static_cast<const W*>(a.weight);
  const DType out_dtype = dense_out_dtype(a);
  for (int64_t p = p0; p < p1; ++p) {
    const W* panel = weight + p * a.k * kDensePanelRows;
    const int32_t col0 = static_cast<int32_t>(p * kDensePanelRows);
    const int32_t cols = std::min(kDensePanelRows, a.n - col0);
    // A whole panel without bias in float32 or bfloat16 goes to the output from the last
    // chunk's accumulators (AccRows); otherwise through acc and dense_store_out.
    const bool direct = a.bias == nullptr && cols == kDensePanelRows &&
                        (out_dtype == DType::kFloat32 || out_dtype == DType::kBFloat16);
    const AccRows to_acc{acc, OutRows{reinterpret_cast<char*>(acc), kDensePanelRows * sizeof(float), false}, true};
    const OutRows out{static_cast<char*>(a.out), a.out_stride * dtype_size(out_dtype), out_dtype == DType::kBFloat16};
    const AccRows to_out{acc, out.from(m0, col0), false};
    for (int32_t k0 = 0; k0 < a.k; k0 += kKChunk) {
      const int32_t kc = std::min(kKChunk, a.k - k0);
      const W* chunk = panel + static_cast<int64_t>(k0) * kDensePanelRows;
      const float* xc = x + m0 * x_stride + k0;
      const int32_t next_kc = next_chunk_values(a.k, k0, kc, kKChunk, p + 1 == p1);
      const W* next = next_kc > 0 ? chunk + static_cast<int64_t>(kc) * kDensePanelRows : nullptr;
      AccRows rows = direct && k0 + kc == a.k ? to_out : to_acc;
      rows.first = k0 == 0;
      if (widen) {
        // Widening is the chunk's first read: the first pass over the widened chunk fetches
        // the next 16-bit chunk.
        widen_chunk(chunk, kc, tile);
        panel_chunk(xc, x_stride, mc, static_cast<const float*>(tile), kc, rows, next);
      } else {
        panel_chunk(xc, x_stride, mc, chunk, kc, rows, chunk + kPrefetchRows * kDensePanelRows,
                    reinterpret_cast<const char*>(next), static_cast<int64_t>(next_kc) * kDensePanelRows * sizeof(W));
      }
    }
    if (!direct) {
      for (int64_t i = 0; i < mc; ++i) dense_store_out(a, m0 + i, col0, cols, acc + i * kDensePanelRows);
    }
  }
}

inline void run_task(const DenseMatmulArgs& a, const float* x, int64_t x_stride, const DensePlan& plan,
                     int64_t task) {
  switch (a.weight_dtype) {
    case DType::kFloat32: run_task_typed<float>(a, x, x_stride, plan, task); break;
    case DType::kBFloat16: run_task_typed<BF16>(a, x, x_stride, plan, task); break;
    case DType::kFloat16: run_task_typed<F16>(a, x, x_stride, plan, task); break;
  }
}

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE::dense
