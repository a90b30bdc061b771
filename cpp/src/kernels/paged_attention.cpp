// paged_attention: checks the arguments, cuts the work into tasks (attention_task.h),
// runs them on the thread pool with the selected ISA build, and for partitioned decode
// merges the partial softmax results.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention_task.h"
#include "thread_pool.h"
#include "vpage/common.h"
#include "vpage/kernels/cpu_kernels.h"
#include "vpage/kernels/half.h"

namespace vpage::cpu {
namespace {

constexpr int kMaxRowsPerTask = 16;         // query rows (queries x heads) of one task
constexpr int kPartitionTokens = 512;       // decode: context partition (rounded up to whole blocks)
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

// Checks everything the kernels rely on (block-table entries only of the blocks that are read).
void validate(const PagedAttentionArgs& a, int num_threads) {
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
  if (a.num_seqs == 0) return;
  VPAGE_CHECK(a.out && a.query && a.key_cache && a.value_cache && a.block_tables && a.context_lens,
              op << ": null data pointer");
  if (a.query_start_loc == nullptr) {
    VPAGE_CHECK(a.num_query_tokens == a.num_seqs, op << ": decode needs num_query_tokens == num_seqs");
  } else {
    VPAGE_CHECK(a.query_start_loc[0] == 0, op << ": query_start_loc[0] must be 0");
    VPAGE_CHECK(a.query_start_loc[a.num_seqs] == a.num_query_tokens,
                op << ": query_start_loc[num_seqs] must equal num_query_tokens (" << a.num_query_tokens << ")");
  }
  VPAGE_CHECK(!a.draft_queries || a.query_start_loc != nullptr, op << ": draft_queries needs query_start_loc");
  // VPAGE_CHECK builds its message only on failure: this loop runs once per sequence and call.
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
  }
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

// The selected build's decode and prefill tasks; on CPUs with AVX512-BF16 the AVX-512 levels take
// the ones whose bfloat16 QK uses bf16 dot products (the same scratch as the AVX-512 build's).
AttentionTaskFn decode_task(const AttentionKernels& kernels) {
#if defined(VPAGE_AVX512BF16_KERNELS)
  if (use_bf16_dot_tasks(kernels)) return avx512bf16::kDecodeTask;
#endif
  return kernels.run_task;
}

AttentionTaskFn prefill_task(const AttentionKernels& kernels) {
#if defined(VPAGE_AVX512BF16_KERNELS)
  if (use_bf16_dot_tasks(kernels)) return avx512bf16::kPrefillTask;
#endif
  return kernels.run_prefill_task;
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
    // Threads claim tasks in turn, so a thread's next task is likely num_threads further on.
    for (size_t i = 0; i + num_threads < tasks.size(); ++i) tasks[i].next = &tasks[i + num_threads];
  }
  const AttentionKernels& kernels = selected_kernels();
  int32_t max_rows = 0;
  for (const AttentionTask& t : tasks) max_rows = std::max(max_rows, t.num_queries * t.num_heads);
  const int64_t scratch_floats = (prefill_kernel ? kernels.prefill_scratch_floats : kernels.scratch_floats)(
      max_rows, a.cache.head_size, a.cache.block_size);
  const AttentionTaskFn task_fn = prefill_kernel ? prefill_task(kernels) : decode_task(kernels);
  ThreadPool::instance().parallel_for(static_cast<int64_t>(tasks.size()), num_threads,
                                      [&](int64_t index, int) {
                                        thread_local std::vector<float> scratch;
                                        if (static_cast<int64_t>(scratch.size()) < scratch_floats) {
                                          scratch.resize(scratch_floats);
                                        }
                                        task_fn(a, tasks[index], scratch.data());
                                      });
}

// Queries that take the decode kernel: `count` consecutive query rows of sequence `seq` from
// `first_row`, the last one at context length `len` (query j sees positions up to
// len - count + j), all read from token `begin` (a block start).
struct DecodeSpan {
  int32_t seq = 0, count = 1, len = 0, begin = 0;
  int64_t first_row = 0;
};

// A query of context length `len` read from `begin` is scored over the partitions
// [begin + p * partition, begin + (p + 1) * partition) up to len, p < partitions_of(...), one
// task each, whose (max, sum, o) are then merged. The cut depends on nothing but the query's
// own length, so neither the batch it runs in nor the thread count changes its result.
int32_t partitions_of(int32_t len, int32_t begin, int32_t partition) {
  return std::max(1, (len - begin + partition - 1) / partition);
}

// Where a span's partial results lie within its part of the buffer: [partition][head part]
// [query][head in part][2 + head_size] (a task's rows, queries x heads, are consecutive).
int64_t partial_row(const DecodeSpan& d, int32_t num_heads, int32_t p, int32_t first_head, int32_t heads,
                    int32_t query, int32_t head_in_part) {
  return static_cast<int64_t>(p) * d.count * num_heads + static_cast<int64_t>(d.count) * first_head +
         static_cast<int64_t>(query) * heads + head_in_part;
}

// Merges the per-partition (max, sum, o) of every (query, head) of the spans that have more
// than one partition (offset[i] >= 0: span i's part of `partial`) into out.
void reduce_partitions(const PagedAttentionArgs& a, const std::vector<DecodeSpan>& spans,
                       const std::vector<int64_t>& offset, const std::vector<float>& partial, int32_t partition,
                       int num_threads) {
  const int32_t hs = a.cache.head_size;
  const int64_t row_floats = 2 + hs;
  const int32_t group = a.num_heads / a.cache.num_kv_heads;
  const int32_t per_task = heads_per_task(a);
  std::vector<size_t> merged;      // spans with partials
  std::vector<int64_t> first_item; // their first (query, head) item
  int64_t items = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    if (offset[i] < 0) continue;
    merged.push_back(i);
    first_item.push_back(items);
    items += static_cast<int64_t>(spans[i].count) * a.num_heads;
  }
  ThreadPool::instance().parallel_for(items, num_threads, [&](int64_t item, int) {
    const size_t k = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const DecodeSpan& d = spans[merged[k]];
    const int64_t local = item - first_item[k];
    const int32_t query = static_cast<int32_t>(local / a.num_heads), head = static_cast<int32_t>(local % a.num_heads);
    const int32_t in_group = head % group, part_start = in_group / per_task * per_task;
    const int32_t heads = std::min(per_task, group - part_start);
    const int32_t first_head = head - in_group + part_start;
    const int32_t used = partitions_of(d.len - d.count + 1 + query, d.begin, partition);
    auto row = [&](int32_t p) {
      return partial.data() + offset[merged[k]] +
             partial_row(d, a.num_heads, p, first_head, heads, query, in_group - part_start) * row_floats;
    };
    float global_max = -INFINITY;
    for (int32_t p = 0; p < used; ++p) global_max = std::max(global_max, row(p)[0]);
    thread_local std::vector<float> o;
    o.assign(hs, 0.0f);
    float sum = 0.0f;
    for (int32_t p = 0; p < used; ++p) {
      const float* part = row(p);
      if (part[1] == 0.0f) continue;
      const float weight = std::exp(part[0] - global_max);
      sum += part[1] * weight;
      for (int32_t v = 0; v < hs; ++v) o[v] += part[2 + v] * weight;
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (float& v : o) v *= inv;
    store_row(a, (d.first_row + query) * a.num_heads + head, o.data());
  });
}

// The decode kernel's tasks for `spans`: per span, GQA head part and partition, its queries in
// chunks of up to kMaxRowsPerTask rows (a chunk reads the K/V once for all its queries; a
// query's rows come out bitwise as they would alone, its later neighbours' tokens masked).
void run_decode(const PagedAttentionArgs& a, const std::vector<DecodeSpan>& spans, int num_threads) {
  const int32_t per_task = heads_per_task(a);
  const int32_t bs = a.cache.block_size;
  const int32_t partition = (kPartitionTokens + bs - 1) / bs * bs;
  const int32_t queries_per_task = std::max(1, kMaxRowsPerTask / per_task);
  const int64_t row_floats = 2 + a.cache.head_size;
  std::vector<int64_t> offset(spans.size(), -1);
  int64_t partial_floats = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    const int32_t parts = partitions_of(spans[i].len, spans[i].begin, partition);
    if (parts == 1) continue;  // one partition: the task writes normalised rows to out
    offset[i] = partial_floats;
    partial_floats += static_cast<int64_t>(parts) * spans[i].count * a.num_heads * row_floats;
  }
  std::vector<float> partial(static_cast<size_t>(partial_floats));
  std::vector<AttentionTask> tasks;
  for (size_t i = 0; i < spans.size(); ++i) {
    const DecodeSpan& d = spans[i];
    const int32_t parts = partitions_of(d.len, d.begin, partition);
    for_each_head_part(a, per_task, [&](int32_t kv, int32_t first_head, int32_t heads) {
      for (int32_t p = 0; p < parts; ++p) {
        const int32_t ctx_begin = d.begin + p * partition;
        for (int32_t q0 = 0; q0 < d.count; q0 += queries_per_task) {
          const int32_t n = std::min(queries_per_task, d.count - q0);
          const int32_t last_len = d.len - d.count + q0 + n;  // the chunk's last query's context
          if (p > 0 && ctx_begin >= last_len) continue;      // no query of the chunk reaches it
          AttentionTask t;
          t.seq = d.seq;
          t.kv_head = kv;
          t.first_head = first_head;
          t.num_heads = heads;
          t.first_query = d.first_row + q0;
          t.num_queries = n;
          t.first_visible_end = last_len - n + 1;
          t.ctx_begin = std::min(ctx_begin, last_len);
          t.ctx_end = std::min(last_len, ctx_begin + partition);
          if (offset[i] >= 0) {
            t.partial = partial.data() + offset[i] + partial_row(d, a.num_heads, p, first_head, heads, q0, 0) * row_floats;
          }
          tasks.push_back(t);
        }
      }
    });
  }
  run(a, tasks, num_threads, false);
  if (partial_floats > 0) reduce_partitions(a, spans, offset, partial, partition, num_threads);
}

// Decode: one query per sequence, at its context length.
void decode(const PagedAttentionArgs& a, int num_threads) {
  std::vector<DecodeSpan> spans(a.num_seqs);
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const int32_t len = a.context_lens[s];
    spans[s] = {s, 1, len, first_read_token(a, len, 1), s};
  }
  run_decode(a, spans, num_threads);
}

// A mixed batch: sequences with several queries (prompt chunks) take the prefill kernel; those
// with one (decode tokens scheduled beside the chunks) take the decode kernel, as they do in a
// decode-only step, so a decode token's attention does not depend on whether another request's
// prompt happened to share its step. With draft_queries every sequence's queries take the
// decode kernel (with a window, each query alone: its window starts at its own block).
void prefill(const PagedAttentionArgs& a, int num_threads) {
  const int32_t per_task = heads_per_task(a);
  // Prefill tasks hold up to kPrefillRowVecs SIMD vectors of rows (queries x heads).
  const int32_t queries_per_task = std::max(1, kPrefillRowVecs * selected_kernels().lanes / per_task);
  std::vector<AttentionTask> tasks;
  std::vector<DecodeSpan> spans;
  for (int32_t s = 0; s < a.num_seqs; ++s) {
    const int32_t begin = a.query_start_loc[s];
    const int32_t queries = a.query_start_loc[s + 1] - begin;
    const int32_t len = a.context_lens[s];
    if (queries == 0) continue;
    if (queries == 1 || (a.draft_queries && a.sliding_window <= 0)) {
      spans.push_back({s, queries, len, first_read_token(a, len - queries + 1, 1), begin});
      continue;
    }
    if (a.draft_queries) {
      for (int32_t j = 0; j < queries; ++j) {
        const int32_t len_j = len - queries + 1 + j;
        spans.push_back({s, 1, len_j, first_read_token(a, len_j, 1), begin + j});
      }
      continue;
    }
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
        tasks.push_back(t);
      }
    });
  }
  if (!tasks.empty()) run(a, tasks, num_threads, true);
  if (!spans.empty()) run_decode(a, spans, num_threads);
}

}  // namespace

bool use_bf16_dot_tasks(const AttentionKernels& kernels) {
#if defined(VPAGE_AVX512BF16_KERNELS)
  static const bool has_bf16_dot = __builtin_cpu_supports("avx512bf16");
  return has_bf16_dot && std::strncmp(kernels.name, "avx512", 6) == 0;
#else
  (void)kernels;
  return false;
#endif
}

void paged_attention(const PagedAttentionArgs& args, int num_threads) {
  validate(args, num_threads);
  if (args.num_seqs == 0) return;
  if (args.query_start_loc == nullptr) {
    decode(args, num_threads);
  } else {
    prefill(args, num_threads);
  }
}

}  // namespace vpage::cpu
