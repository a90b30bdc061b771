// packed_attention: checks the arguments, cuts the work into (sequence, head, query tile)
// tasks and runs them on the thread pool with the selected ISA build's rows-in-lanes kernel
// (attention_prefill_impl.h).
#include <algorithm>
#include <limits>
#include <vector>

#include "attention_task.h"
#include "thread_pool.h"
#include "vpage/common.h"
#include "vpage/kernels/cpu_kernels.h"

namespace vpage::cpu {
namespace {

constexpr int kPackedRowVecs = 3;  // SIMD vectors of query rows per task

void validate(const PackedAttentionArgs& a, int num_threads) {
  const char* op = "packed_attention";
  constexpr int64_t kIntMax = std::numeric_limits<int32_t>::max();
  VPAGE_CHECK(num_threads >= 1, op << ": num_threads must be >= 1, got " << num_threads);
  VPAGE_CHECK(a.dtype == DType::kFloat32 || a.dtype == DType::kFloat16 || a.dtype == DType::kBFloat16,
              op << ": unknown dtype code " << static_cast<int>(a.dtype));
  VPAGE_CHECK(a.head_size > 0 && a.head_size % 16 == 0,
              op << ": head_size must be a positive multiple of 16, got " << a.head_size);
  VPAGE_CHECK(a.num_heads > 0, op << ": num_heads must be positive, got " << a.num_heads);
  VPAGE_CHECK(a.num_seqs >= 0 && a.num_query_rows >= 0 && a.num_kv_rows >= 0, op << ": negative count");
  VPAGE_CHECK(a.window >= 0, op << ": window must be >= 0 (0: none), got " << a.window);
  const int64_t width = static_cast<int64_t>(a.num_heads) * a.head_size;
  for (const int64_t stride : {a.query_stride, a.key_stride, a.value_stride, a.out_stride}) {
    VPAGE_CHECK(stride >= width && stride <= kIntMax,
                op << ": row strides must lie in [num_heads * head_size, 2^31), got " << stride);
  }
  if (a.num_seqs == 0) return;
  VPAGE_CHECK(a.out && a.query && a.key && a.value && a.kv_starts && a.kv_lens && a.q_starts && a.q_lens &&
                  a.q_offsets,
              op << ": null data pointer");
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const int64_t kv_start = a.kv_starts[s], q_start = a.q_starts[s];  // sums below in 64 bits
    const int32_t len = a.kv_lens[s], queries = a.q_lens[s], offset = a.q_offsets[s];
    VPAGE_CHECK(len >= 0 && kv_start >= 0 && kv_start + len <= a.num_kv_rows,
                op << ": key rows [" << kv_start << ", " << kv_start + len << ") of sequence " << s
                   << " outside [0, " << a.num_kv_rows << ")");
    VPAGE_CHECK(queries >= 0 && q_start >= 0 && q_start + queries <= a.num_query_rows,
                op << ": query rows [" << q_start << ", " << q_start + queries << ") of sequence " << s
                   << " outside [0, " << a.num_query_rows << ")");
    VPAGE_CHECK(offset >= 0 && static_cast<int64_t>(offset) + queries <= len,
                op << ": queries at positions [" << offset << ", " << static_cast<int64_t>(offset) + queries
                   << ") of sequence " << s << " outside its " << len << " tokens");
  }
}

}  // namespace

void packed_attention(const PackedAttentionArgs& a, int num_threads) {
  validate(a, num_threads);
  const AttentionKernels& kernels = selected_kernels();
  const int32_t per_task = kPackedRowVecs * kernels.lanes;
  // Longest sequences first; a sequence's tasks of one head stay together (they read the same K/V).
  std::vector<int32_t> order(a.num_seqs);
  for (int32_t s = 0; s < a.num_seqs; ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(), [&a](int32_t l, int32_t r) { return a.kv_lens[l] > a.kv_lens[r]; });
  std::vector<PackedTask> tasks;
  for (const int32_t s : order) {
    for (int32_t h = 0; h < a.num_heads; ++h) {
      for (int32_t q = 0; q < a.q_lens[s]; q += per_task) tasks.push_back({s, h, q, std::min(per_task, a.q_lens[s] - q)});
    }
  }
  if (tasks.empty()) return;
  int32_t max_rows = 0;
  for (const PackedTask& t : tasks) max_rows = std::max(max_rows, t.num_queries);
  const int64_t scratch_floats = kernels.prefill_scratch_floats(max_rows, a.head_size, kPackedTile);
  PackedTaskFn task_fn = kernels.run_packed_task;
#if defined(VPAGE_AVX512BF16_KERNELS)
  if (use_bf16_dot_tasks(kernels)) task_fn = avx512bf16::kPackedTask;  // bf16 dot-product QK
#endif
  ThreadPool::instance().parallel_for(static_cast<int64_t>(tasks.size()), num_threads, [&](int64_t index, int) {
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < scratch_floats) scratch.resize(scratch_floats);
    task_fn(a, tasks[index], scratch.data());
  });
}

}  // namespace vpage::cpu
