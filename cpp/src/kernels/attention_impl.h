// The CPU paged attention task kernel, written once over simd_vec.h and compiled once per
// instruction set (attention_<isa>.cpp defines VPAGE_ISA_NAMESPACE and includes this file).
//
// A task (see attention_task.h) owns R = queries x heads rows of one GQA group and walks
// the context block by block, reading each K/V block once for all R rows:
//   QK: a key block row c holds [block_size][x] elements; one vector covers kLanes/x
//       tokens x x dims and is multiplied by the query fragment q[c*x, c*x+x) repeated
//       (precomputed per row), accumulated over c, then summed over the x lanes.
//   softmax: online, fp32, per row; the accumulator is rescaled only when the max grows.
//   PV: the value block [head_size][block_size] is one flat array; every vector is
//       multiplied by the probabilities tiled to the same pattern and accumulated into
//       a per-row [head_size][block_size] fp32 accumulator, summed over tokens at the end.
// Only the scratch passed in is used: no allocation, no std templates (see simd_vec.h).
#pragma once

#include <math.h>

#include <cstdint>

#include "attention_task.h"
#include "simd_vec.h"

#if defined(__GNUC__) || defined(__clang__)
#define VPAGE_PREFETCH(ptr) __builtin_prefetch(ptr)
#else
#define VPAGE_PREFETCH(ptr) ((void)(ptr))
#endif

namespace vpage::cpu::VPAGE_ISA_NAMESPACE {

constexpr int kMaxRowsPerPass = 8;  // QK accumulators held in registers at once
constexpr int kPrefetchBlocks = 2;  // prefetch the K/V block this many blocks ahead
constexpr float kNegInf = -INFINITY;

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }
inline int64_t gcd(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

/// Scratch layout of one task (all offsets in floats, each region a multiple of kLanes).
struct Scratch {
  int64_t qrep, part, logits, ptile, acc, vtmp, max, sum, total;
  int row_vecs, logits_len, ptile_len;
  Scratch(int32_t rows, int32_t head_size, int32_t block_size, int x) {
    row_vecs = static_cast<int>((static_cast<int64_t>(block_size) * x + kLanes - 1) / kLanes);
    logits_len = static_cast<int>(round_up(block_size, kLanes));
    ptile_len = static_cast<int>(block_size / gcd(block_size, kLanes) * kLanes);
    qrep = 0;
    part = qrep + static_cast<int64_t>(rows) * (head_size / x) * kLanes;
    logits = part + static_cast<int64_t>(rows) * row_vecs * kLanes;
    ptile = logits + static_cast<int64_t>(rows) * logits_len;
    acc = ptile + static_cast<int64_t>(rows) * ptile_len;
    vtmp = acc + static_cast<int64_t>(rows) * head_size * block_size;
    max = vtmp + static_cast<int64_t>(head_size) * block_size;
    sum = max + round_up(rows, kLanes);
    total = sum + round_up(rows, kLanes);
  }
};

inline int64_t scratch_floats(int32_t rows, int32_t head_size, int32_t block_size) {
  const int64_t fp32 = Scratch(rows, head_size, block_size, 4).total;
  const int64_t half = Scratch(rows, head_size, block_size, 8).total;
  return fp32 > half ? fp32 : half;
}

// QK for rows [r0, r0 + N) of one block: part[r][v*kLanes + lane] = sum over c.
template <int N, typename T>
inline void qk_rows(const T* key_block, const float* qrep, float* part, int r0, int num_chunks,
                    int row_len, int row_vecs) {
  for (int v = 0; v < row_vecs; ++v) {
    Vec acc[N];
    for (int i = 0; i < N; ++i) acc[i] = zero();
    const int offset = v * kLanes;
    const bool tail = offset + kLanes > row_len;
    for (int c = 0; c < num_chunks; ++c) {
      const T* src = key_block + static_cast<int64_t>(c) * row_len + offset;
      const Vec k = tail ? load_partial(src, row_len - offset) : load(src);
      for (int i = 0; i < N; ++i) {
        acc[i] = fma(k, load(qrep + (static_cast<int64_t>(r0 + i) * num_chunks + c) * kLanes), acc[i]);
      }
    }
    for (int i = 0; i < N; ++i) store(part + static_cast<int64_t>(r0 + i) * row_vecs * kLanes + offset, acc[i]);
  }
}

template <typename T>
inline void qk_block(const T* key_block, const float* qrep, float* part, int rows, int num_chunks,
                     int row_len, int row_vecs) {
  int r0 = 0;
  for (; r0 + kMaxRowsPerPass <= rows; r0 += kMaxRowsPerPass) {
    qk_rows<kMaxRowsPerPass>(key_block, qrep, part, r0, num_chunks, row_len, row_vecs);
  }
  switch (rows - r0) {
    case 1: qk_rows<1>(key_block, qrep, part, r0, num_chunks, row_len, row_vecs); break;
    case 2: qk_rows<2>(key_block, qrep, part, r0, num_chunks, row_len, row_vecs); break;
    case 3: qk_rows<3>(key_block, qrep, part, r0, num_chunks, row_len, row_vecs); break;
    case 4: qk_rows<4>(key_block, qrep, part, r0, num_chunks, row_len, row_vecs); break;
    case 5: qk_rows<5>(key_block, qrep, part, r0, num_chunks, row_len, row_vecs); break;
    case 6: qk_rows<6>(key_block, qrep, part, r0, num_chunks, row_len, row_vecs); break;
    case 7: qk_rows<7>(key_block, qrep, part, r0, num_chunks, row_len, row_vecs); break;
    default: break;
  }
}

// PV for one block: acc[r][i] += v[i] * p[r][i mod ptile_len] over the flat value block.
// Also prefetches the K/V block `kPrefetchBlocks` ahead (next_key/next_value, or nullptr),
// spread over the loop so the prefetches overlap with the arithmetic instead of stalling.
template <typename T, typename Next>
inline void pv_block(const T* value_block, const float* ptile, float* acc, int rows, int64_t block_elems,
                     int ptile_len, const Next* next_key, const Next* next_value) {
  constexpr int64_t kLine = 64;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(Next));
  const int64_t lines_per_vec = (block_bytes / kLine + block_elems / kLanes - 1) / (block_elems / kLanes);
  const char* next_k = reinterpret_cast<const char*>(next_key);
  const char* next_v = reinterpret_cast<const char*>(next_value);
  int pi = 0;
  int64_t line = 0;
  for (int64_t i = 0; i < block_elems; i += kLanes) {
    if (next_k != nullptr) {
      for (int64_t l = 0; l < lines_per_vec && line < block_bytes; ++l, line += kLine) {
        VPAGE_PREFETCH(next_k + line);
        VPAGE_PREFETCH(next_v + line);
      }
    }
    const Vec v = load(value_block + i);
    for (int r = 0; r < rows; ++r) {
      float* dst = acc + r * block_elems + i;
      store(dst, fma(v, load(ptile + r * ptile_len + pi), load(dst)));
    }
    pi += kLanes;
    if (pi == ptile_len) pi = 0;
  }
}

template <typename T>
inline void prefetch_block(const T* block, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(block);
  const int64_t bytes = elems * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) VPAGE_PREFETCH(p + off);
}

template <typename T>
void run_task_typed(const PagedAttentionArgs& a, const AttentionTask& task, float* scratch) {
  constexpr int x = 16 / static_cast<int>(sizeof(T));
  const int hs = a.cache.head_size;
  const int bs = a.cache.block_size;
  const int num_chunks = hs / x;
  const int row_len = bs * x;
  const int64_t block_elems = static_cast<int64_t>(hs) * bs;
  const int rows = task.num_queries * task.num_heads;
  const Scratch s(rows, hs, bs, x);
  float* qrep = scratch + s.qrep;
  float* part = scratch + s.part;
  float* logits = scratch + s.logits;
  float* ptile = scratch + s.ptile;
  float* acc = scratch + s.acc;
  float* vtmp = scratch + s.vtmp;
  float* row_max = scratch + s.max;
  float* row_sum = scratch + s.sum;

  // Queries, scaled, as repeated x-fragments: qrep[r][c][lane] = q[c*x + lane % x] * scale.
  const T* query = static_cast<const T*>(a.query);
  const Vec scale = set1(a.scale);
  for (int r = 0; r < rows; ++r) {
    const int q = r / task.num_heads;
    const int head = task.first_head + r % task.num_heads;
    const T* src = query + (task.first_query + q) * a.query_stride + static_cast<int64_t>(head) * hs;
    float* scaled = vtmp;  // free until the first value block
    for (int d = 0; d < hs; d += kLanes) store(scaled + d, mul(load(src + d), scale));
    float* dst = qrep + static_cast<int64_t>(r) * num_chunks * kLanes;
    for (int c = 0; c < num_chunks; ++c) {
      for (int lane = 0; lane < kLanes; ++lane) dst[c * kLanes + lane] = scaled[c * x + lane % x];
    }
    row_max[r] = kNegInf;
    row_sum[r] = 0.0f;
  }
  for (int64_t i = 0; i < rows * block_elems; i += kLanes) store(acc + i, zero());

  const T* key_cache = static_cast<const T*>(a.key_cache);
  const T* value_cache = static_cast<const T*>(a.value_cache);
  const int32_t* table = a.block_tables + static_cast<int64_t>(task.seq) * a.max_blocks_per_seq;
  const int64_t head_offset = static_cast<int64_t>(task.kv_head) * block_elems;
  const int64_t block_stride = static_cast<int64_t>(a.cache.num_kv_heads) * block_elems;
  const int first_block = task.ctx_begin / bs;
  const int end_block = (task.ctx_end + bs - 1) / bs;
  for (int b = first_block; b < end_block; ++b) {
    const int64_t physical = table[b];
    const T* key_block = key_cache + physical * block_stride + head_offset;
    const T* value_block = value_cache + physical * block_stride + head_offset;
    const T* next_key = nullptr;
    const T* next_value = nullptr;
    if (b + kPrefetchBlocks < end_block) {
      const int64_t next = table[b + kPrefetchBlocks] * block_stride + head_offset;
      next_key = key_cache + next;
      next_value = value_cache + next;
    } else if (b == first_block) {
      for (int ahead = 1; ahead < kPrefetchBlocks && b + ahead < end_block; ++ahead) {
        const int64_t next = table[b + ahead] * block_stride + head_offset;
        prefetch_block(key_cache + next, block_elems);
        prefetch_block(value_cache + next, block_elems);
      }
    }
    const int base = b * bs;
    const int valid = task.ctx_end - base < bs ? task.ctx_end - base : bs;

    qk_block(key_block, qrep, part, rows, num_chunks, row_len, s.row_vecs);

    // Logits with the causal/context mask, online max, probabilities.
    for (int r = 0; r < rows; ++r) {
      const int visible_end = task.first_visible_end + r / task.num_heads;
      const int limit = visible_end - base < valid ? visible_end - base : valid;
      const float* row_part = part + static_cast<int64_t>(r) * s.row_vecs * kLanes;
      float* row_logits = logits + static_cast<int64_t>(r) * s.logits_len;
      for (int t = 0; t < bs; ++t) {
        float logit = 0.0f;
        for (int j = 0; j < x; ++j) logit += row_part[t * x + j];
        row_logits[t] = logit;
      }
      float block_max = kNegInf;
      for (int t = 0; t < limit; ++t) block_max = row_logits[t] > block_max ? row_logits[t] : block_max;
      for (int t = limit > 0 ? limit : 0; t < s.logits_len; ++t) row_logits[t] = kNegInf;
      if (block_max > row_max[r]) {
        if (row_max[r] != kNegInf) {
          const float alpha = expf(row_max[r] - block_max);
          const Vec alpha_vec = set1(alpha);
          float* row_acc = acc + r * block_elems;
          for (int64_t i = 0; i < block_elems; i += kLanes) store(row_acc + i, mul(load(row_acc + i), alpha_vec));
          row_sum[r] *= alpha;
        }
        row_max[r] = block_max;
      }
      const Vec shift = set1(row_max[r] == kNegInf ? 0.0f : -row_max[r]);
      Vec sum = zero();
      for (int t = 0; t < s.logits_len; t += kLanes) {
        const Vec p = exp_nonpositive(add(load(row_logits + t), shift));
        store(row_logits + t, p);
        sum = add(sum, p);
      }
      row_sum[r] += reduce_add(sum);
      float* row_ptile = ptile + static_cast<int64_t>(r) * s.ptile_len;
      for (int i = 0; i < s.ptile_len; ++i) row_ptile[i] = row_logits[i % bs];
    }

    // PV: a partial last block is copied with its unwritten tokens zeroed (they may hold
    // NaN, and 0 * NaN would poison the accumulator).
    if (valid < bs) {
      for (int64_t i = 0; i < block_elems; i += kLanes) store(vtmp + i, load(value_block + i));
      for (int d = 0; d < hs; ++d) {
        for (int t = valid; t < bs; ++t) vtmp[static_cast<int64_t>(d) * bs + t] = 0.0f;
      }
      pv_block(vtmp, ptile, acc, rows, block_elems, s.ptile_len, next_key, next_value);
    } else {
      pv_block(value_block, ptile, acc, rows, block_elems, s.ptile_len, next_key, next_value);
    }
  }

  // Sum the accumulator over tokens: o[d] = sum_t acc[d][t].
  for (int r = 0; r < rows; ++r) {
    const float* row_acc = acc + r * block_elems;
    float* o = vtmp;
    if (bs % kLanes == 0) {
      for (int d = 0; d < hs; ++d) {
        Vec sum = zero();
        for (int t = 0; t < bs; t += kLanes) sum = add(sum, load(row_acc + static_cast<int64_t>(d) * bs + t));
        o[d] = reduce_add(sum);
      }
    } else {
      for (int d = 0; d < hs; ++d) o[d] = 0.0f;
      for (int t = 0; t < bs; ++t) {
        for (int d = 0; d < hs; ++d) o[d] += row_acc[static_cast<int64_t>(d) * bs + t];
      }
    }
    const int q = r / task.num_heads;
    const int head = task.first_head + r % task.num_heads;
    if (task.partial != nullptr) {
      float* dst = task.partial + static_cast<int64_t>(r) * (2 + hs);
      dst[0] = row_max[r];
      dst[1] = row_sum[r];
      for (int d = 0; d < hs; ++d) dst[2 + d] = o[d];
    } else {
      T* dst = static_cast<T*>(a.out) + ((task.first_query + q) * a.num_heads + head) * static_cast<int64_t>(hs);
      const Vec inv = set1(row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f);
      for (int d = 0; d < hs; d += kLanes) store(dst + d, mul(load(o + d), inv));
    }
  }
}

inline void run_task(const PagedAttentionArgs& args, const AttentionTask& task, float* scratch) {
  switch (args.cache.dtype) {
    case DType::kFloat32: run_task_typed<float>(args, task, scratch); break;
    case DType::kFloat16: run_task_typed<F16>(args, task, scratch); break;
    case DType::kBFloat16: run_task_typed<BF16>(args, task, scratch); break;
  }
}

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE
