// paged_attention: checks the arguments, cuts the work into tasks (attention_task.h),
// runs them on the thread pool with the selected ISA build, and for partitioned decode
// merges the partial softmax results.
#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_task.h"
#include "thread_pool.h"
#include "vpage/common.h"
#include "vpage/kernels/cpu_kernels.h"
#include "vpage/kernels/half.h"

namespace vpage::cpu {
namespace {

constexpr int kMaxRowsPerTask = 16;         // query rows (queries x heads) of one task
constexpr int kTasksPerThread = 4;          // decode: split contexts below this many tasks
constexpr int kMinPartitionTokens = 256;    // decode: smallest context partition
constexpr int kPrefillRowVecs = 3;          // prefill: SIMD vectors of query rows per task

// Queries of sequence s: 1 for decode.
int32_t num_queries(const PagedAttentionArgs& a, int32_t s) {
  return a.query_start_loc == nullptr ? 1 : a.query_start_loc[s + 1] - a.query_start_loc[s];
}

// First context token read for a sequence of `len` tokens whose queries are its last
// `queries`: the start of the block holding the earliest query's first windowed key.
int32_t first_read_token(const PagedAttentionArgs& a, int32_t len, int32_t queries) {
  return window_first_block(a.sliding_window, a.cache.block_size, len - queries) * a.cache.block_size;
}

// Checks everything the kernels rely on (block-table entries only of the blocks that are
// read); returns the most context tokens one sequence's decode query reads.
int32_t validate(const PagedAttentionArgs& a, int num_threads) {
  const CacheShape& c = a.cache;
  const char* op = "paged_attention";
  VPAGE_CHECK(num_threads >= 1, op << ": num_threads must be >= 1, got " << num_threads);
  VPAGE_CHECK(c.dtype == DType::kFloat32 || c.dtype == DType::kFloat16 || c.dtype == DType::kBFloat16,
              op << ": unknown dtype code " << static_cast<int>(c.dtype));
  VPAGE_CHECK(kv_dtypes_supported(a.dtype, c.dtype),
              op << ": query dtype code " << static_cast<int>(a.dtype) << " cannot read a cache of dtype code "
                 << static_cast<int>(c.dtype) << " (same dtype, or a float32 query with a 16-bit cache)");
  VPAGE_CHECK(c.head_size > 0 && c.head_size % 16 == 0,
              op << ": head_size must be a positive multiple of 16, got " << c.head_size);
  VPAGE_CHECK(c.block_size > 0, op << ": block_size must be positive, got " << c.block_size);
  VPAGE_CHECK(c.num_kv_heads > 0, op << ": num_kv_heads must be positive");
  VPAGE_CHECK(c.num_blocks >= 0, op << ": num_blocks must be >= 0");
  VPAGE_CHECK(a.num_heads > 0 && a.num_heads % c.num_kv_heads == 0,
              op << ": num_heads (" << a.num_heads << ") must be a positive multiple of num_kv_heads ("
                 << c.num_kv_heads << ")");
  VPAGE_CHECK(a.num_seqs >= 0 && a.max_blocks_per_seq >= 0, op << ": num_seqs and max_blocks_per_seq must be >= 0");
  VPAGE_CHECK(a.query_stride >= static_cast<int64_t>(a.num_heads) * c.head_size,
              op << ": query_stride must be >= num_heads * head_size");
  VPAGE_CHECK(a.sliding_window >= 0, op << ": sliding_window must be >= 0 (0: none), got " << a.sliding_window);
  VPAGE_CHECK(a.logits_soft_cap >= 0.0f && std::isfinite(a.logits_soft_cap),
              op << ": logits_soft_cap must be finite and >= 0 (0: none), got " << a.logits_soft_cap);
  if (a.num_seqs == 0) return 0;
  VPAGE_CHECK(a.out && a.query && a.key_cache && a.value_cache && a.block_tables && a.context_lens,
              op << ": null data pointer");
  if (a.query_start_loc == nullptr) {
    VPAGE_CHECK(a.num_query_tokens == a.num_seqs, op << ": decode needs num_query_tokens == num_seqs");
  } else {
    VPAGE_CHECK(a.query_start_loc[0] == 0, op << ": query_start_loc[0] must be 0");
    VPAGE_CHECK(a.query_start_loc[a.num_seqs] == a.num_query_tokens,
                op << ": query_start_loc[num_seqs] must equal num_query_tokens (" << a.num_query_tokens << ")");
  }
  // VPAGE_CHECK builds its message only on failure: this loop runs once per sequence and call.
  int32_t longest = 0;
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const int32_t len = a.context_lens[s];
    VPAGE_CHECK(len >= 0 && static_cast<int64_t>(len) <= static_cast<int64_t>(a.max_blocks_per_seq) * c.block_size,
                op << ": context length " << len << " outside [0, max_blocks_per_seq * block_size] (sequence " << s
                   << ")");
    VPAGE_CHECK(len <= a.max_context_len, op << ": context length " << len << " exceeds max_context_len "
                                             << a.max_context_len << " (sequence " << s << ")");
    const int32_t queries = num_queries(a, s);
    if (a.query_start_loc != nullptr) {
      VPAGE_CHECK(queries >= 0, op << ": query_start_loc must be non-decreasing (sequence " << s << ")");
      VPAGE_CHECK(queries <= len, op << ": more query tokens (" << queries << ") than context length (" << len
                                     << ") (sequence " << s << ")");
    }
    // The blocks read: from the earliest query's window to the context end (none without queries).
    const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.max_blocks_per_seq;
    const int32_t used = queries > 0 ? (len + c.block_size - 1) / c.block_size : 0;
    const int32_t first = used > 0 ? first_read_token(a, len, queries) / c.block_size : 0;
    for (int32_t b = first; b < used; ++b) {
      VPAGE_CHECK(table[b] >= 0 && table[b] < c.num_blocks,
                  op << ": block id " << table[b] << " out of range [0, " << c.num_blocks << ") (sequence " << s
                     << "), logical block " << b);
    }
    if (a.query_start_loc == nullptr) longest = std::max(longest, len - first_read_token(a, len, 1));
  }
  return longest;
}

// Rows of tasks: a GQA group is split into ceil(group / kMaxRowsPerTask) equal parts.
int32_t heads_per_task(const PagedAttentionArgs& a) {
  const int32_t group = a.num_heads / a.cache.num_kv_heads;
  const int32_t splits = (group + kMaxRowsPerTask - 1) / kMaxRowsPerTask;
  return (group + splits - 1) / splits;
}

template <typename Fn>
void for_each_head_part(const PagedAttentionArgs& a, int32_t per_task, Fn&& fn) {
  const int32_t group = a.num_heads / a.cache.num_kv_heads;
  for (int32_t kv = 0; kv < a.cache.num_kv_heads; ++kv) {
    for (int32_t h = 0; h < group; h += per_task) fn(kv, kv * group + h, std::min(per_task, group - h));
  }
}

// Writes one output row (query token x head) of head_size values in the output dtype.
void store_row(const PagedAttentionArgs& a, int64_t row, const float* values) {
  const int32_t hs = a.cache.head_size;
  if (a.dtype == DType::kFloat32) {
    std::copy(values, values + hs, static_cast<float*>(a.out) + row * hs);
    return;
  }
  uint16_t* dst = static_cast<uint16_t*>(a.out) + row * hs;
  for (int32_t d = 0; d < hs; ++d) {
    dst[d] = a.dtype == DType::kFloat16 ? float_to_half(values[d]) : float_to_bfloat16(values[d]);
  }
}

// Merges the per-partition (max, sum, o) of every (sequence, head) into out.
void reduce_partitions(const PagedAttentionArgs& a, const std::vector<float>& partial, int32_t partitions,
                       int32_t partition_tokens, int num_threads) {
  const int32_t hs = a.cache.head_size;
  const int64_t stride = 2 + hs;
  ThreadPool::instance().parallel_for(
      static_cast<int64_t>(a.num_seqs) * a.num_heads, num_threads, [&](int64_t item, int) {
        const int64_t s = item / a.num_heads;
        const int64_t head = item % a.num_heads;
        const int32_t len = a.context_lens[s];
        const int32_t read = len - first_read_token(a, len, 1);
        const int32_t used = std::max(1, (read + partition_tokens - 1) / partition_tokens);
        const float* first = partial.data() + (s * partitions * a.num_heads + head) * stride;
        const int64_t step = a.num_heads * stride;
        float global_max = -INFINITY;
        for (int32_t p = 0; p < used; ++p) global_max = std::max(global_max, first[p * step]);
        std::vector<float> o(hs, 0.0f);
        float sum = 0.0f;
        for (int32_t p = 0; p < used; ++p) {
          const float* part = first + p * step;
          if (part[1] == 0.0f) continue;
          const float weight = std::exp(part[0] - global_max);
          sum += part[1] * weight;
          for (int32_t d = 0; d < hs; ++d) o[d] += part[2 + d] * weight;
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        for (float& v : o) v *= inv;
        store_row(a, s * a.num_heads + head, o.data());
      });
}

void run(const PagedAttentionArgs& a, std::vector<AttentionTask>& tasks, int num_threads, bool prefill_kernel) {
  if (prefill_kernel) {
    // Longest sequences first, but the tasks of one (sequence, KV head) stay together (in
    // the order made: longest query tile first), so the threads taking consecutive tasks
    // keep re-reading the same K/V from their L2.
    std::stable_sort(tasks.begin(), tasks.end(), [&a](const AttentionTask& l, const AttentionTask& r) {
      return a.context_lens[l.seq] > a.context_lens[r.seq];
    });
  } else {
    std::stable_sort(tasks.begin(), tasks.end(), [](const AttentionTask& l, const AttentionTask& r) {
      return l.ctx_end - l.ctx_begin > r.ctx_end - r.ctx_begin;
    });
  }
  const AttentionKernels& kernels = selected_kernels();
  int32_t max_rows = 0;
  for (const AttentionTask& t : tasks) max_rows = std::max(max_rows, t.num_queries * t.num_heads);
  const int64_t scratch_floats = (prefill_kernel ? kernels.prefill_scratch_floats : kernels.scratch_floats)(
      max_rows, a.cache.head_size, a.cache.block_size);
  const AttentionTaskFn task_fn = prefill_kernel ? kernels.run_prefill_task : kernels.run_task;
  ThreadPool::instance().parallel_for(static_cast<int64_t>(tasks.size()), num_threads,
                                      [&](int64_t index, int) {
                                        thread_local std::vector<float> scratch;
                                        if (static_cast<int64_t>(scratch.size()) < scratch_floats) {
                                          scratch.resize(scratch_floats);
                                        }
                                        task_fn(a, tasks[index], scratch.data());
                                      });
}

// Decode: the query of a sequence of `len` tokens reads tokens [begin, len), begin the start of
// its window's first block; that span is cut into partitions of partition_tokens tokens
// (a multiple of block_size) when there are too few tasks for the threads. `longest` is the
// longest span.
void decode(const PagedAttentionArgs& a, int32_t longest, int num_threads) {
  const int32_t per_task = heads_per_task(a);
  const int64_t base_tasks = static_cast<int64_t>(a.num_seqs) * (a.num_heads / per_task);
  int32_t partitions = 1;
  if (num_threads > 1 && base_tasks < static_cast<int64_t>(kTasksPerThread) * num_threads) {
    const int64_t wanted = (static_cast<int64_t>(kTasksPerThread) * num_threads + base_tasks - 1) / base_tasks;
    const int64_t most = std::max<int64_t>(1, longest / kMinPartitionTokens);
    partitions = static_cast<int32_t>(std::min(wanted, most));
  }
  const int32_t bs = a.cache.block_size;
  const int32_t partition_tokens =
      partitions == 1 ? std::max(longest, 1) : ((longest + partitions - 1) / partitions + bs - 1) / bs * bs;
  if (partitions > 1) partitions = (longest + partition_tokens - 1) / partition_tokens;

  std::vector<float> partial;
  if (partitions > 1) {
    partial.resize(static_cast<size_t>(a.num_seqs) * partitions * a.num_heads * (2 + a.cache.head_size));
  }
  std::vector<AttentionTask> tasks;
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const int32_t len = a.context_lens[s];
    const int32_t begin = first_read_token(a, len, 1);
    const int32_t used = partitions == 1 ? 1 : std::max(1, (len - begin + partition_tokens - 1) / partition_tokens);
    for_each_head_part(a, per_task, [&](int32_t kv, int32_t first_head, int32_t heads) {
      for (int32_t p = 0; p < used; ++p) {
        AttentionTask t;
        t.seq = s;
        t.kv_head = kv;
        t.first_head = first_head;
        t.num_heads = heads;
        t.first_query = s;
        t.num_queries = 1;
        t.first_visible_end = len;
        t.ctx_begin = std::min(len, begin + p * partition_tokens);
        t.ctx_end = partitions == 1 ? len : std::min(len, begin + (p + 1) * partition_tokens);
        if (partitions > 1) {
          t.partial = partial.data() +
                      ((static_cast<int64_t>(s) * partitions + p) * a.num_heads + first_head) * (2 + a.cache.head_size);
        }
        tasks.push_back(t);
      }
    });
  }
  run(a, tasks, num_threads, false);
  if (partitions > 1) reduce_partitions(a, partial, partitions, partition_tokens, num_threads);
}

// A mixed batch: sequences with several queries (prompt chunks) take the prefill kernel; those
// with one (decode tokens scheduled beside the chunks) take the decode kernel, as they do in a
// decode-only step, so a decode token's attention does not depend on whether another request's
// prompt happened to share its step (with one partition, as here and as in decode steps of
// short contexts, the results are bitwise the same; speed measured the same either way).
void prefill(const PagedAttentionArgs& a, int num_threads) {
  const int32_t per_task = heads_per_task(a);
  // Prefill tasks hold up to kPrefillRowVecs SIMD vectors of rows (queries x heads).
  const int32_t queries_per_task = std::max(1, kPrefillRowVecs * selected_kernels().lanes / per_task);
  std::vector<AttentionTask> tasks, single_query_tasks;
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const int32_t begin = a.query_start_loc[s];
    const int32_t queries = a.query_start_loc[s + 1] - begin;
    const int32_t len = a.context_lens[s];
    for_each_head_part(a, per_task, [&](int32_t kv, int32_t first_head, int32_t heads) {
      const int32_t tiles = (queries + queries_per_task - 1) / queries_per_task;
      for (int32_t tile = tiles - 1; tile >= 0; --tile) {
        const int32_t q = tile * queries_per_task;
        AttentionTask t;
        t.seq = s;
        t.kv_head = kv;
        t.first_head = first_head;
        t.num_heads = heads;
        t.first_query = begin + q;
        t.num_queries = std::min(queries_per_task, queries - q);
        t.first_visible_end = len - queries + q + 1;
        // Key blocks wholly before the window of the tile's first query are skipped.
        t.ctx_begin = first_read_token(a, len - queries + q + 1, 1);
        t.ctx_end = t.first_visible_end + t.num_queries - 1;
        (queries == 1 ? single_query_tasks : tasks).push_back(t);
      }
    });
  }
  if (!tasks.empty()) run(a, tasks, num_threads, true);
  if (!single_query_tasks.empty()) run(a, single_query_tasks, num_threads, false);
}

}  // namespace

void paged_attention(const PagedAttentionArgs& args, int num_threads) {
  const int32_t longest = validate(args, num_threads);
  if (args.num_seqs == 0) return;
  if (args.query_start_loc == nullptr) {
    decode(args, longest, num_threads);
  } else {
    prefill(args, num_threads);
  }
}

}  // namespace vpage::cpu
