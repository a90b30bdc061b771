// Dense matmul dispatcher: checks the arguments, packs weights, converts 16-bit x to float32,
// picks the ISA build that set_cpu_isa selected for attention, plans the tasks and runs them
// on the kernels' parallel_for.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_task.h"
#include "dense_task.h"
#include "float_rows.h"
#include "thread_pool.h"
#include "vpage/common.h"

namespace vpage::cpu {
namespace {

// x rows per task: a block's rows x 256 values of k (256 KiB) stay in L2 while a task's
// panels go by.
constexpr int64_t kMBlock = 256;
// Below this many x rows the weights' bytes, not the FMAs, bound a matmul: each thread gets
// about kTasksPerThread long runs of panels, which keep its hardware prefetcher streaming
// (and a thread held up by another process is balanced out). From it on, one panel per task,
// so the threads finish together (x's block is read from L2 per panel either way).
constexpr int64_t kStreamingRows = 16;
constexpr int64_t kTasksPerThread = 4;

bool known_dtype(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

void check_args(const DenseMatmulArgs& a) {
  VPAGE_CHECK(known_dtype(a.dtype) && known_dtype(a.weight_dtype),
              "dense_matmul: unknown dtype code " << static_cast<int>(a.dtype) << " or weight dtype code "
                                                  << static_cast<int>(a.weight_dtype));
  VPAGE_CHECK(a.m >= 0 && a.n >= 0 && a.k > 0 && a.x_stride >= a.k && a.out_stride >= a.n,
              "dense_matmul: bad sizes (m " << a.m << ", n " << a.n << ", k " << a.k << ", x_stride " << a.x_stride
                                            << ", out_stride " << a.out_stride << ")");
  VPAGE_CHECK((a.m == 0 || (a.x != nullptr && a.out != nullptr)) && (a.n == 0 || a.weight != nullptr),
              "dense_matmul: null pointer");
}

// Panel p of W [n, k] (row stride w_stride) into packed[p] [k, 32], zeros past row n.
template <typename T>
void pack_panel(const T* weight, int32_t n, int32_t k, int64_t w_stride, int64_t p, T* packed) {
  T* panel = packed + p * k * kDensePanelRows;
  const int64_t rows = std::min<int64_t>(kDensePanelRows, n - p * kDensePanelRows);
  for (int64_t j = 0; j < k; ++j) {
    T* out = panel + j * kDensePanelRows;
    for (int64_t c = 0; c < rows; ++c) out[c] = weight[(p * kDensePanelRows + c) * w_stride + j];
    for (int64_t c = rows; c < kDensePanelRows; ++c) out[c] = T{};
  }
}

}  // namespace

const DenseKernels& selected_dense_kernels() {
  const char* name = selected_kernels().name;
#if defined(VPAGE_X86_KERNELS)
#if defined(VPAGE_AVX512BF16_KERNELS)
  static const bool has_bf16_dot = __builtin_cpu_supports("avx512bf16");
  if (std::strncmp(name, "avx512", 6) == 0 && has_bf16_dot) return avx512bf16::kDenseKernels;
#endif
  if (std::strncmp(name, "avx512", 6) == 0) return avx512::kDenseKernels;
  if (std::strncmp(name, "avx2", 4) == 0) return avx2::kDenseKernels;
#endif
  (void)name;
  return generic::kDenseKernels;
}

DensePlan dense_plan(const DenseMatmulArgs& a, int num_threads) {
  DensePlan plan;
  plan.m_block = std::min(a.m, kMBlock);
  plan.num_panels = (a.n + kDensePanelRows - 1) / kDensePanelRows;
  const int64_t m_blocks = (a.m + plan.m_block - 1) / plan.m_block;
  const int64_t wanted_groups =
      a.m < kStreamingRows ? (kTasksPerThread * num_threads + m_blocks - 1) / m_blocks : plan.num_panels;
  const int64_t groups = std::clamp<int64_t>(wanted_groups, 1, plan.num_panels);
  plan.panels_per_task = (plan.num_panels + groups - 1) / groups;
  plan.panel_groups = (plan.num_panels + plan.panels_per_task - 1) / plan.panels_per_task;
  return plan;
}

void dense_store_out(const DenseMatmulArgs& a, int64_t row, int32_t col0, int32_t cols, const float* values) {
  const DType out_dtype = dense_out_dtype(a);
  const int64_t offset = (row * a.out_stride + col0) * dtype_size(out_dtype);
  store_float32_row(out_dtype, static_cast<char*>(a.out) + offset, values, a.bias == nullptr ? nullptr : a.bias + col0,
                    cols);
}

void dense_pack(DType dtype, const void* weight, int32_t n, int32_t k, int64_t w_stride, void* packed,
                int num_threads) {
  VPAGE_CHECK(known_dtype(dtype), "dense_pack: unknown dtype code " << static_cast<int>(dtype));
  VPAGE_CHECK(n >= 0 && k > 0 && w_stride >= k, "dense_pack: bad sizes (n " << n << ", k " << k << ", w_stride "
                                                                              << w_stride << ")");
  VPAGE_CHECK(n == 0 || (weight != nullptr && packed != nullptr), "dense_pack: null pointer");
  const int64_t num_panels = (n + kDensePanelRows - 1) / kDensePanelRows;
  ThreadPool::instance().parallel_for(num_panels, std::max(num_threads, 1), [&](int64_t p, int) {
    if (dtype == DType::kFloat32) {
      pack_panel(static_cast<const float*>(weight), n, k, w_stride, p, static_cast<float*>(packed));
    } else {
      pack_panel(static_cast<const uint16_t*>(weight), n, k, w_stride, p, static_cast<uint16_t*>(packed));
    }
  });
}

void dense_matmul(const DenseMatmulArgs& args, int num_threads) {
  check_args(args);
  if (args.m == 0 || args.n == 0) return;
  num_threads = std::max(num_threads, 1);
  const DenseKernels& kernels = selected_dense_kernels();
  if (kernels.run_bf16_task != nullptr && args.dtype == DType::kBFloat16 && args.weight_dtype == DType::kBFloat16) {
    const DensePlan plan = dense_plan(args, num_threads);
    const int64_t num_tasks = (args.m + plan.m_block - 1) / plan.m_block * plan.panel_groups;
    ThreadPool::instance().parallel_for(num_tasks, num_threads, [&](int64_t task, int) {
      kernels.run_bf16_task(args, plan, task);
    });
    return;
  }
  thread_local std::vector<float> converted;
  int64_t x_stride = 0;
  const float* x = float32_rows(args.dtype, args.x, args.m, args.k, args.x_stride, converted, &x_stride, num_threads);
  const DensePlan plan = dense_plan(args, num_threads);
  const int64_t num_tasks = (args.m + plan.m_block - 1) / plan.m_block * plan.panel_groups;
  ThreadPool::instance().parallel_for(num_tasks, num_threads, [&](int64_t task, int) {
    kernels.run_task(args, x, x_stride, plan, task);
  });
}

const char* dense_matmul_isa() { return selected_dense_kernels().name; }

}  // namespace vpage::cpu
