// Per-ISA entry points of the quantized matmul (quant_matmul_impl.h, built once per
// instruction set) and the plan the dispatcher (quant_matmul.cpp) hands them. Declarations
// only, so nothing here is compiled with ISA flags.
#pragma once

#include <cstdint>

#include "vpage/kernels/quant_matmul.h"

namespace vpage::cpu {

/// How a matmul is cut: task t covers weight rows [t * rows_per_task, ...) for all of x;
/// inside a task, x rows go m_chunk at a time and K goes k_chunk values at a time.
struct QuantPlan {
  int32_t rows_per_task = 0;  // a multiple of QuantKernels::rows_multiple
  int32_t k_chunk = 0;        // a multiple of 256 (hence of every block size)
  int64_t m_chunk = 0;
  bool k_major = false;       // prefill tile layout and micro-kernel (see quant_matmul_impl.h)
};

/// x rows quantized to 8 bits per 32 values for the integer decode path (quant_dot_impl.h):
/// q [m, q_stride] (each row's blocks in pairs, bytes in the kernel's order), d and s
/// [m, k / 32] (scale and scale * sum of q of each block), `pairs`, the same scales laid
/// out for the SIMD kernels (quant_x_pairs), [ceil(m / 4), (k / 32 + 1) / 2, 16], and sums
/// [m, k / 32], each block's sum of q.
struct QuantizedX {
  const int8_t* q = nullptr;
  int64_t q_stride = 0;
  const float* d = nullptr;
  const float* s = nullptr;
  const float* pairs = nullptr;
  const int32_t* sums = nullptr;
};

/// Bytes per row of QuantizedX::q: k rounded up to whole block pairs (64 values).
constexpr int64_t quant_x_row_bytes(int32_t k) { return (static_cast<int64_t>(k) + 63) / 64 * 64; }

/// Bytes per block pair of a kQ4_1x4 group: 8 f16 d, 8 f16 m, 4 rows x 32 nibble bytes.
constexpr int64_t kQ4_1x4PairBytes = 160;
/// Bytes per block pair of a kQ8_0x4 group: 8 f16 d, 4 rows x 64 quants.
constexpr int64_t kQ8_0x4PairBytes = 272;

/// Whether `type` is a layout of four-row groups (kQ4_1x4, kQ8_0x4).
constexpr bool quant_is_x4(QuantType type) { return type == QuantType::kQ4_1x4 || type == QuantType::kQ8_0x4; }

/// Whether `type` is a layout of eight-row groups (kQ4_1x8, kQ8_0x8).
constexpr bool quant_is_x8(QuantType type) { return type == QuantType::kQ4_1x8 || type == QuantType::kQ8_0x8; }

/// Bytes per block of a kQ4_1x8 / kQ8_0x8 group (eight rows' blocks: d, Q4_1's m, quants).
constexpr int64_t quant_x8_block_bytes(QuantType type) { return type == QuantType::kQ8_0x8 ? 272 : 160; }

/// Whether `type` is a repacked layout of file rows (x4 or x8).
constexpr bool quant_is_repacked(QuantType type) { return quant_is_x4(type) || quant_is_x8(type); }

/// Floats per block pair and x group in QuantizedX::pairs.
constexpr int32_t kXPairFloats = 16;

/// Floats per x group (4 rows) in QuantizedX::pairs.
constexpr int64_t quant_x_group_floats(int32_t blocks) { return static_cast<int64_t>((blocks + 1) / 2) * kXPairFloats; }

/// Fills pairs [ceil(m / 4), (blocks + 1) / 2, 16] from d, s [m, blocks] for weight type
/// `type`: x rows go in groups of 4 (rows past m: zeros), and pair p of a group covers blocks
/// 2p and 2p + 1 (absent in the last pair of an odd count: zeros) in two 8-float vectors laid
/// out as the SIMD kernels' lanes (quant_dot_impl.h), row j of the group in lanes j and 4 + j:
///   [0, 8):  the x scale d, block 2p in lanes 0-3, block 2p + 1 in lanes 4-7;
///   [8, 16): the x factor of the weight header's offset, the same way: Q4_1 and Q4_K s (times m_w),
///            Q4_0 -8 s (times d_w), zeros for Q8_0.
void quant_x_pairs(QuantType type, const float* d, const float* s, int64_t m, int32_t blocks, float* pairs);

/// Runs task `task` of `plan`: x is float32 [args.m, args.k] with row stride x_stride
/// (args.x is ignored); writes out rows for the task's columns.
using QuantTaskFn = void (*)(const QuantMatmulArgs& args, const float* x, int64_t x_stride, const QuantPlan& plan,
                             int64_t task);
/// Dequantizes `rows` whole rows of `k` values into out [rows, k].
using QuantDequantizeFn = void (*)(QuantType type, const uint8_t* weight, int64_t rows, int32_t k, float* out);

/// Quantizes m rows of x (k a multiple of 32) into q [m, quant_x_row_bytes(k)], d, s, sums (see QuantizedX).
using QuantizeXFn = void (*)(const float* x, int64_t x_stride, int64_t m, int32_t k, int8_t* q, float* d, float* s,
                             int32_t* sums);
/// Integer decode path, Q4_0, Q4_1, Q8_0, Q4_K, (SIMD builds) the x4 types, m <= kQuantIntegerPathRows,
/// and (VNNI) the x8 types, any m: task `task` covers weight rows [task * rows_per_task, ...).
using QuantDotTaskFn = void (*)(const QuantMatmulArgs& args, const QuantizedX& x, int32_t rows_per_task,
                                int64_t task);
// The integer GEMM path (quant_gemm_impl.h) for more rows has the same signature.

/// The entry points of one ISA build.
struct QuantKernels {
  const char* name;
  QuantTaskFn run_task;
  QuantDequantizeFn dequantize_rows;
  QuantizeXFn quantize_x;
  QuantDotTaskFn run_dot_task;
  QuantDotTaskFn run_gemm_task;
  bool integer_x4;         // whether the integer paths read x4 rows and the GEMM x8 rows (else unpacked first)
  bool integer_x8;         // whether the decode path reads x8 rows (else unpacked first)
  int32_t rows_multiple;   // weight rows per decode micro-kernel column group
  int32_t panel_rows;      // weight rows per prefill micro-kernel panel
};

/// Writes out[row, col0 : col0 + cols] = values (converted to args.dtype). Compiled once
/// with baseline flags (quant_matmul.cpp), so every ISA build shares its conversions.
void quant_store_out(const QuantMatmulArgs& args, int64_t row, int32_t col0, int32_t cols, const float* values);

/// The entry points of the level set_cpu_isa selected (quant_matmul.cpp).
const QuantKernels& selected_quant_kernels();

/// Whether `args` takes an integer path (32-value formats: x must be quantized first, by
/// quant_quantize_x).
bool quant_integer_path(const QuantMatmulArgs& args);

/// x [args.m, args.k] (float32, row stride x_stride) quantized for the integer paths in
/// args.type's pair layout, threads over rows. The buffers are thread_local to the calling
/// thread: valid until its next call.
QuantizedX quant_quantize_x(const QuantMatmulArgs& args, const float* x, int64_t x_stride, int num_threads);

/// The view of quantized x from row `first_row` (a multiple of 4, the pair layout's group)
/// on, for rows of `k` values.
QuantizedX quant_x_rows(const QuantizedX& qx, int32_t k, int64_t first_row);

/// One quantized matmul cut into tasks the way quant_matmul cuts it: run(task) for every
/// task in [0, num_tasks), in any order, on any threads (the tasks write disjoint columns).
struct QuantMatmulTasks {
  QuantMatmulArgs args;
  const float* x = nullptr;  // float32 [args.m, args.k], row stride x_stride (float paths)
  int64_t x_stride = 0;
  QuantizedX qx;             // integer paths
  QuantPlan plan;            // float paths
  const QuantKernels* kernels = nullptr;
  QuantDotTaskFn integer_task = nullptr;  // the integer path's task, or nullptr (float paths)
  int32_t integer_rows = 0;               // weight rows per integer task (after the head tasks)
  // The decode path's first head_tasks tasks take head_rows rows each (see dot_task_shape).
  int32_t head_tasks = 0;
  int32_t head_rows = 0;
  int64_t num_tasks = 0;
  bool unpack_rows = false;  // x4 or x8 rows on a path without a kernel for them

  /// Runs task `task`.
  void run(int64_t task) const;

 private:
  /// The weight rows [*n0, *n0 + *rows) of task `task`, and the rows a task of its kind takes.
  int32_t task_rows(int64_t task, int32_t* n0, int32_t* rows) const;
  /// args restricted to weight rows [n0, n0 + rows) and their output columns.
  QuantMatmulArgs rows_args(int32_t n0, int32_t rows) const;
  void run_unpacked(int64_t task) const;
};

/// The tasks of `args` for `num_threads` threads, with x already float32 (and quantized on an
/// integer path); args.x is ignored.
QuantMatmulTasks quant_matmul_tasks(const QuantMatmulArgs& args, const float* x, int64_t x_stride,
                                    const QuantizedX& qx, int num_threads);

namespace generic {
extern const QuantKernels kQuantKernels;
}
namespace avx2 {
extern const QuantKernels kQuantKernels;
}
namespace avx2vnni {
extern const QuantKernels kQuantKernels;
}
namespace avx512 {
extern const QuantKernels kQuantKernels;
}
namespace avx512vnni {
extern const QuantKernels kQuantKernels;
}

}  // namespace vpage::cpu
