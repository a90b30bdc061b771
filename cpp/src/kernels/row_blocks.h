// Row blocking shared by the dense matmul micro-kernels (whole blocks of a kernel's row count,
// then one smaller kernel for the rest), the output rows they store to, their aligned scratch
// and the chunk a task reads next. Include it inside an ISA namespace (like simd_vec.h), so builds with different flags
// never share an instantiation.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd_vec.h"  // Vec, BF16 and store, in namespace VPAGE_ISA_NAMESPACE

#ifndef VPAGE_ISA_NAMESPACE
#error "define VPAGE_ISA_NAMESPACE before including row_blocks.h"
#endif

namespace vpage::cpu::VPAGE_ISA_NAMESPACE {

template <int R, typename Fn>
inline void last_row_block(int64_t rows, int64_t first, Fn& fn) {
  if constexpr (R > 0) {
    if (rows == R) {
      fn(std::integral_constant<int, R>{}, first);
    } else {
      last_row_block<R - 1>(rows, first, fn);
    }
  }
}

/// fn(std::integral_constant<int, R>{}, first_row) over rows [0, rows): R = kRows while whole
/// blocks fit, then R = rows % kRows once.
template <int kRows, typename Fn>
inline void for_row_blocks(int64_t rows, Fn&& fn) {
  int64_t i = 0;
  for (; i + kRows <= rows; i += kRows) fn(std::integral_constant<int, kRows>{}, i);
  last_row_block<kRows - 1>(rows - i, i, fn);
}

/// Rows a micro-kernel stores its results to: row i at data + i * row_bytes, float32 values or
/// bfloat16 ones (rounded as float_to_bfloat16).
struct OutRows {
  char* data = nullptr;
  int64_t row_bytes = 0;
  bool bf16 = false;

  /// The same rows from row `row`, column `col` on.
  OutRows from(int64_t row, int64_t col) const {
    return {data + row * row_bytes + col * (bf16 ? 2 : 4), row_bytes, bf16};
  }
  VPAGE_ALWAYS_INLINE void store_vec(int64_t row, int64_t col, Vec v) const {
    char* p = data + row * row_bytes + col * (bf16 ? 2 : 4);
    if (bf16) return store(reinterpret_cast<BF16*>(p), v);
    store(reinterpret_cast<float*>(p), v);
  }
};

/// n floats of `scratch` from a 64-byte boundary, so that no vector load splits a cache line
/// (a widened tile at malloc's 16 bytes made the AVX2 bfloat16 matmuls ~5% slower at 256 rows).
inline float* aligned_scratch(std::vector<float>& scratch, size_t n) {
  scratch.resize(n + 64 / sizeof(float));
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
}

/// Values of k in the chunk a task reads after [k0, k0 + kc) of a panel of k values (chunks of
/// `chunk` values): the panel's next chunk, or after its last the next panel's first, which
/// starts right after it (packed panels are contiguous); 0 after the task's last panel.
inline int32_t next_chunk_values(int32_t k, int32_t k0, int32_t kc, int32_t chunk, bool last_panel) {
  if (k0 + kc < k) return std::min(chunk, k - k0 - kc);
  return last_panel ? 0 : std::min(chunk, k);
}

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE
