// Per-ISA entry point of the dense matmul (dense_matmul_impl.h, built once per instruction
// set) and the plan the dispatcher (dense_matmul.cpp) hands it. Declarations only, so nothing
// here is compiled with ISA flags.
#pragma once

#include <cstdint>

#include "vpage/kernels/dense_matmul.h"

namespace vpage::cpu {

/// How a matmul is cut: task t covers x rows [t / panel_groups * m_block, ...) (m_block of
/// them) and panels [t % panel_groups * panels_per_task, ...) (panels_per_task of them).
struct DensePlan {
  int64_t m_block = 0;
  int64_t panels_per_task = 0;
  int64_t panel_groups = 0;  // ceil(num_panels / panels_per_task)
  int64_t num_panels = 0;    // ceil(n / kDensePanelRows)
};

/// Runs task `task` of `plan`: x is float32 [args.m, args.k] with row stride x_stride
/// (args.x is ignored); writes the task's block of out.
using DenseTaskFn = void (*)(const DenseMatmulArgs& args, const float* x, int64_t x_stride, const DensePlan& plan,
                             int64_t task);

/// Runs task `task` of `plan` on bfloat16 x (args.x, unconverted) and bfloat16 weights.
using DenseBf16TaskFn = void (*)(const DenseMatmulArgs& args, const DensePlan& plan, int64_t task);

/// The entry points of one ISA build.
struct DenseKernels {
  const char* name;
  DenseTaskFn run_task;
  DenseBf16TaskFn run_bf16_task;  // bf16 x bf16 with bf16 dot products, or nullptr
};

/// Writes out[row, col0 : col0 + cols] = values (+ bias[col0 : col0 + cols]) in args.dtype.
/// Compiled once with baseline flags (dense_matmul.cpp).
void dense_store_out(const DenseMatmulArgs& args, int64_t row, int32_t col0, int32_t cols, const float* values);

/// The entry points of the level set_cpu_isa selected (dense_matmul.cpp).
const DenseKernels& selected_dense_kernels();

/// How dense_matmul cuts `args` for `num_threads` threads: ceil(m / m_block) * panel_groups tasks.
DensePlan dense_plan(const DenseMatmulArgs& args, int num_threads);

namespace generic {
extern const DenseKernels kDenseKernels;
}
namespace avx2 {
extern const DenseKernels kDenseKernels;
}
namespace avx512 {
extern const DenseKernels kDenseKernels;
}
namespace avx512bf16 {
extern const DenseKernels kDenseKernels;
}

}  // namespace vpage::cpu
