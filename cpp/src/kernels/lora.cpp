// lora_add (lora.h): the batch's rows grouped by adapter slot, then two parallel_for runs of the
// dense matmul's per-ISA tasks (dense_task.h) over every group at once (on the calling thread
// alone for a call of a few rows).
//
// Rows in group order: a counting sort by slot puts group g's rows at [row0, row0 + rows) of
// `order` (their batch rows). Buffers (float32):
//   T [m_lora, t_cols]  shrink output x @ A^T of every gathered row; group g uses its first
//                       num_slices * rank_g columns, slice j's at j * rank_g (A's row layout)
//   per task scratch    the shrink's gathered x rows [rows, k]; the expand's block of
//                       T_j @ B_j^T [rows, cols], added into out's rows by the same task
// Each task runs as a matmul of its own (its rows, its run of panels: packed panels are
// contiguous) with a one-task plan, so its output can go to a scratch buffer; the kernel sums
// every output in k order whatever the cut, so the cut changes no bits.
#include "vpage/kernels/lora.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "dense_task.h"
#include "float_rows.h"
#include "thread_pool.h"
#include "vpage/common.h"
#include "vpage/kernels/dense_matmul.h"

namespace vpage::cpu {
namespace {

// Rows per shrink task: enough to use the micro-kernel's rows, few enough that a task's
// gathered rows stay in L2 and a small batch still spreads over the threads.
constexpr int64_t kShrinkMinRows = 8;
constexpr int64_t kShrinkMaxRows = 64;
// Below this many multiply-adds (all rows, shrink and expand) the call runs on the calling
// thread, one task per matmul: a decode step of a few rows costs a few microseconds of
// arithmetic, less than waking the other threads twice for every projection of every layer.
constexpr int64_t kInlineMacs = int64_t{1} << 18;

bool known_dtype(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

void check_args(const LoraArgs& a) {
  VPAGE_CHECK(known_dtype(a.dtype) && known_dtype(a.weight_dtype),
              "lora_add: unknown dtype code " << static_cast<int>(a.dtype) << " or weight dtype code "
                                              << static_cast<int>(a.weight_dtype));
  VPAGE_CHECK(a.m >= 0 && a.k > 0 && a.x_stride >= a.k && a.num_slots >= 0 && a.num_slices >= 1 &&
                  a.num_slices <= kMaxLoraSlices,
              "lora_add: bad sizes (m " << a.m << ", k " << a.k << ", x_stride " << a.x_stride << ", slots "
                                        << a.num_slots << ", slices " << a.num_slices << ")");
  int64_t n = 0;
  for (int32_t j = 0; j < a.num_slices; ++j) {
    VPAGE_CHECK(a.slice_rows[j] > 0, "lora_add: slice " << j << " has " << a.slice_rows[j] << " rows");
    n += a.slice_rows[j];
  }
  VPAGE_CHECK(n <= std::numeric_limits<int32_t>::max() && a.out_stride >= n,
              "lora_add: out_stride " << a.out_stride << " is less than the slices' " << n << " columns");
  VPAGE_CHECK((a.m == 0 || (a.out != nullptr && a.x != nullptr && a.token_slots != nullptr)) &&
                  (a.num_slots == 0 || a.slots != nullptr),
              "lora_add: null pointer");
  for (int32_t s = 0; s < a.num_slots; ++s) {
    const int64_t rank = a.slots[s].rank;
    VPAGE_CHECK(a.slots[s].a == nullptr || (rank > 0 && rank <= std::numeric_limits<int32_t>::max() / kMaxLoraSlices),
                "lora_add: slot " << s << " has rank " << rank);
  }
  for (int64_t t = 0; t < a.m; ++t) {
    VPAGE_CHECK(a.token_slots[t] >= -1 && a.token_slots[t] < a.num_slots,
                "lora_add: row " << t << " names slot " << a.token_slots[t] << " of " << a.num_slots);
  }
}

// The rows of one slot, at [row0, row0 + rows) of the group order.
struct Group {
  const LoraAdapterWeights* adapter;
  int64_t row0;
  int64_t rows;
};

// One matmul of a group (the shrink, or one slice's expand), cut by `plan`; its tasks are
// [first_task, first_task + task count) of its parallel_for.
struct GroupMatmul {
  const Group* group;
  int32_t slice;         // expand: the slice
  int32_t out_col0;      // expand: the slice's first column of out
  DenseMatmulArgs args;  // m, n, k, weight, weight_dtype (x and out are the task's)
  DensePlan plan;
  int64_t first_task;
};

int64_t task_count(const GroupMatmul& mm) {
  return (mm.args.m + mm.plan.m_block - 1) / mm.plan.m_block * mm.plan.panel_groups;
}

// Task `task` of mm.plan as a matmul of its own: rows [*row0, *row0 + sub.m) and output
// columns [*col0, *col0 + sub.n) of mm, with the weight from its first panel on.
DenseMatmulArgs task_matmul(const GroupMatmul& mm, int64_t task, int64_t* row0, int32_t* col0) {
  const DensePlan& plan = mm.plan;
  DenseMatmulArgs sub = mm.args;
  *row0 = task / plan.panel_groups * plan.m_block;
  const int64_t p0 = task % plan.panel_groups * plan.panels_per_task;
  *col0 = static_cast<int32_t>(p0 * kDensePanelRows);
  sub.m = std::min(plan.m_block, mm.args.m - *row0);
  sub.n = std::min<int32_t>(static_cast<int32_t>(plan.panels_per_task) * kDensePanelRows, mm.args.n - *col0);
  const int64_t panel_bytes = static_cast<int64_t>(mm.args.k) * kDensePanelRows * dtype_size(sub.weight_dtype);
  sub.weight = static_cast<const char*>(mm.args.weight) + p0 * panel_bytes;
  return sub;
}

// Runs `sub` in one task of the selected ISA's kernel: x float32 [sub.m, sub.k], row stride x_stride.
void run_matmul(const DenseMatmulArgs& sub, const float* x, int64_t x_stride) {
  DensePlan one;
  one.m_block = sub.m;
  one.num_panels = (sub.n + kDensePanelRows - 1) / kDensePanelRows;
  one.panels_per_task = one.num_panels;
  one.panel_groups = 1;
  selected_dense_kernels().run_task(sub, x, x_stride, one, 0);
}

// Runs every task of `matmuls` on one parallel_for: fn(matmul, its task).
template <typename Fn>
void run_all(std::vector<GroupMatmul>& matmuls, int num_threads, const Fn& fn) {
  int64_t total = 0;
  for (GroupMatmul& mm : matmuls) {
    mm.first_task = total;
    total += task_count(mm);
  }
  ThreadPool::instance().parallel_for(total, num_threads, [&](int64_t task, int) {
    const auto next = std::upper_bound(matmuls.begin(), matmuls.end(), task,
                                       [](int64_t t, const GroupMatmul& mm) { return t < mm.first_task; });
    const GroupMatmul& mm = *(next - 1);
    fn(mm, task - mm.first_task);
  });
}

}  // namespace

void lora_add(const LoraArgs& a, int num_threads) {
  check_args(a);
  num_threads = std::max(num_threads, 1);

  // Counting sort of the rows that have an adapter: slot s's rows at [starts[s], starts[s + 1]).
  // The buffers are this thread's: the tasks below reach them through `order` and `t_rows`.
  thread_local std::vector<int64_t> starts, fill, order_buffer;
  thread_local std::vector<float> t_buffer;
  starts.assign(static_cast<size_t>(a.num_slots) + 1, 0);
  const auto active = [&](int32_t s) { return s >= 0 && a.slots[s].a != nullptr; };
  for (int64_t t = 0; t < a.m; ++t) {
    if (active(a.token_slots[t])) ++starts[a.token_slots[t] + 1];
  }
  for (int32_t s = 0; s < a.num_slots; ++s) starts[s + 1] += starts[s];
  const int64_t m_lora = a.num_slots == 0 ? 0 : starts[a.num_slots];
  if (m_lora == 0) return;
  order_buffer.resize(static_cast<size_t>(m_lora));
  int64_t* const order = order_buffer.data();
  fill.assign(starts.begin(), starts.end() - 1);
  for (int64_t t = 0; t < a.m; ++t) {
    if (active(a.token_slots[t])) order[fill[a.token_slots[t]]++] = t;
  }
  std::vector<Group> groups;
  int64_t t_cols = 0;
  for (int32_t s = 0; s < a.num_slots; ++s) {
    if (starts[s + 1] == starts[s]) continue;
    groups.push_back({&a.slots[s], starts[s], starts[s + 1] - starts[s]});
    t_cols = std::max(t_cols, a.num_slices * a.slots[s].rank);
  }
  t_buffer.resize(static_cast<size_t>(m_lora * t_cols));
  float* const t_rows = t_buffer.data();
  int64_t macs = 0;
  for (const Group& g : groups) {
    int64_t expand_rows = 0;
    for (int32_t j = 0; j < a.num_slices; ++j) expand_rows += g.adapter->b[j] == nullptr ? 0 : a.slice_rows[j];
    macs += g.rows * g.adapter->rank * (a.num_slices * a.k + expand_rows);
  }
  const bool inline_call = macs < kInlineMacs;
  if (inline_call) num_threads = 1;

  DenseMatmulArgs base;
  base.dtype = DType::kFloat32;  // x is passed as float32 rows
  base.float32_out = true;
  base.weight_dtype = a.weight_dtype;
  const int64_t esize = dtype_size(a.dtype);

  // Shrink: T = x @ A^T, a task per block of a group's rows and all of A's panels; the task
  // gathers its rows first.
  const int64_t shrink_rows =
      std::clamp((m_lora + num_threads - 1) / num_threads, kShrinkMinRows, kShrinkMaxRows);
  std::vector<GroupMatmul> shrinks;
  for (const Group& g : groups) {
    GroupMatmul mm{&g, 0, 0, base, {}, 0};
    mm.args.weight = g.adapter->a;
    mm.args.m = g.rows;
    mm.args.n = static_cast<int32_t>(a.num_slices * g.adapter->rank);
    mm.args.k = a.k;
    mm.plan.m_block = std::min(g.rows, shrink_rows);
    mm.plan.num_panels = (mm.args.n + kDensePanelRows - 1) / kDensePanelRows;
    mm.plan.panels_per_task = mm.plan.num_panels;
    mm.plan.panel_groups = 1;
    shrinks.push_back(mm);
  }
  run_all(shrinks, num_threads, [&](const GroupMatmul& mm, int64_t task) {
    thread_local std::vector<float> gathered;
    int64_t row0 = 0;
    int32_t col0 = 0;
    DenseMatmulArgs sub = task_matmul(mm, task, &row0, &col0);
    gathered.resize(static_cast<size_t>(sub.m * a.k));
    const int64_t first = mm.group->row0 + row0;
    for (int64_t i = 0; i < sub.m; ++i) {
      const char* x_row = static_cast<const char*>(a.x) + order[first + i] * a.x_stride * esize;
      load_float32_row(a.dtype, x_row, gathered.data() + i * a.k, a.k);
    }
    sub.out = t_rows + first * t_cols;
    sub.out_stride = t_cols;
    run_matmul(sub, gathered.data(), a.k);
  });

  // Expand: per group and targeted slice j, T_j @ B_j^T cut as dense_matmul cuts it; each task
  // adds its block into out (read as float32, rounded once to out's dtype).
  std::vector<GroupMatmul> expands;
  int32_t out_col0 = 0;
  for (int32_t j = 0; j < a.num_slices; out_col0 += a.slice_rows[j++]) {
    for (const Group& g : groups) {
      if (g.adapter->b[j] == nullptr) continue;
      GroupMatmul mm{&g, j, out_col0, base, {}, 0};
      mm.args.weight = g.adapter->b[j];
      mm.args.m = g.rows;
      mm.args.n = a.slice_rows[j];
      mm.args.k = static_cast<int32_t>(g.adapter->rank);
      if (inline_call) {  // a task per block of the group's rows, with every panel
        mm.plan.m_block = std::min(g.rows, kShrinkMaxRows);
        mm.plan.num_panels = (mm.args.n + kDensePanelRows - 1) / kDensePanelRows;
        mm.plan.panels_per_task = mm.plan.num_panels;
        mm.plan.panel_groups = 1;
      } else {
        mm.plan = dense_plan(mm.args, num_threads);
      }
      expands.push_back(mm);
    }
  }
  run_all(expands, num_threads, [&](const GroupMatmul& mm, int64_t task) {
    thread_local std::vector<float> block, row;
    int64_t row0 = 0;
    int32_t col0 = 0;
    DenseMatmulArgs sub = task_matmul(mm, task, &row0, &col0);
    block.resize(static_cast<size_t>(sub.m * sub.n));
    row.resize(static_cast<size_t>(sub.n));
    sub.out = block.data();
    sub.out_stride = sub.n;
    const int64_t first = mm.group->row0 + row0;
    run_matmul(sub, t_rows + first * t_cols + mm.slice * mm.group->adapter->rank, t_cols);
    for (int64_t i = 0; i < sub.m; ++i) {
      char* out_row = static_cast<char*>(a.out) + (order[first + i] * a.out_stride + mm.out_col0 + col0) * esize;
      load_float32_row(a.dtype, out_row, row.data(), sub.n);
      store_float32_row(a.dtype, out_row, row.data(), block.data() + i * sub.n, sub.n);
    }
  });
}

}  // namespace vpage::cpu
