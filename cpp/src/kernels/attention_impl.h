// The CPU paged attention task kernel, written once over simd_vec.h and compiled once per
// instruction set (attention_<isa>.cpp defines VPAGE_ISA_NAMESPACE and includes this file
// through attention_prefill_impl.h, which adds the prefill task kernel).
//
// A task (see attention_task.h) owns R = queries x heads rows of one GQA group and walks
// the context in groups of kGroupBlocks blocks, reading each K/V block once for all R rows:
//   QK: a key block row c holds [block_size][x] elements; one vector covers kLanes/x
//       tokens x x dims and is multiplied by the query fragment q[c*x, c*x+x) repeated
//       (precomputed per row), accumulated over c, then summed over the x lanes (a tree
//       of pair_sum when block_size is a multiple of kLanes, scalar otherwise).
//   softmax: online, fp32, per row and group; the accumulator is rescaled only when the
//       max grows.
//   PV: the value block [head_size][block_size] is one flat array; every vector is
//       multiplied by the probabilities tiled to the same pattern and accumulated into
//       a per-row [head_size][block_size] fp32 accumulator, summed over tokens at the end.
//       The blocks of a group are accumulated in registers, so the accumulator is loaded
//       and stored once per group instead of once per block.
// run_task (attention_decode_fast_impl.h) uses this kernel only for block sizes that are not
// a multiple of kLanes; the others take the register-blocked decode fast path there.
// Only the scratch passed in is used: no allocation, no std templates (see simd_vec.h).
#pragma once

#include <math.h>

#include <cstdint>

#include "attention_task.h"
#include "simd_vec.h"

#if defined(__GNUC__) || defined(__clang__)
// Prefetch into L2 (not L1: a group's K/V plus the next group's exceed L1; measured
// 5-10% faster than prefetcht0 on contexts that do not fit in L2).
#define VPAGE_PREFETCH_L2(ptr) __builtin_prefetch(ptr, 0, 1)
#else
#define VPAGE_PREFETCH_L2(ptr) ((void)(ptr))
#endif

namespace vpage::cpu::VPAGE_ISA_NAMESPACE {

constexpr int kMaxRowsPerPass = 8;    // QK accumulators held in registers at once
constexpr int kMaxPvRowsPerPass = 4;  // PV accumulators held in registers at once
constexpr int kGroupBlocks = 4;       // blocks per softmax/PV group
constexpr float kNegInf = -INFINITY;

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

template <typename T>
struct Elem {
  using type = T;
};

// Calls fn(Elem<cache element>, Elem<query/out element>) for the dtypes of `a`, one of the
// pairs kv_dtypes_supported allows (paged_attention checked them).
template <typename Fn>
inline void dispatch_kv_dtypes(const PagedAttentionArgs& a, Fn&& fn) {
  const bool float_io = a.dtype == DType::kFloat32;
  switch (a.cache.dtype) {
    case DType::kFloat32: fn(Elem<float>{}, Elem<float>{}); break;
    case DType::kFloat16: float_io ? fn(Elem<F16>{}, Elem<float>{}) : fn(Elem<F16>{}, Elem<F16>{}); break;
    case DType::kBFloat16: float_io ? fn(Elem<BF16>{}, Elem<float>{}) : fn(Elem<BF16>{}, Elem<BF16>{}); break;
  }
}
inline int64_t gcd(int64_t a, int64_t b) {
  while (b != 0) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

/// Scratch layout of one task (all offsets in floats, each region a multiple of kLanes).
/// logits: [rows][kGroupBlocks][logits_len]; ptile: [rows][kGroupBlocks][ptile_len].
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
    ptile = logits + static_cast<int64_t>(rows) * kGroupBlocks * logits_len;
    acc = ptile + static_cast<int64_t>(rows) * kGroupBlocks * ptile_len;
    vtmp = acc + static_cast<int64_t>(rows) * head_size * block_size;
    max = vtmp + round_up(static_cast<int64_t>(head_size) * block_size, kLanes);
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

// Logits of one row from its QK partial sums: logit[t] = sum_j part[t*x + j]. With
// block_size a multiple of kLanes, log2(x) rounds of pair_sum turn the row_vecs vectors
// (kLanes/x tokens each) into block_size/kLanes vectors of consecutive tokens (in place).
inline void part_to_logits(float* part, float* logits, int x, int block_size, int row_vecs) {
  if (block_size % kLanes == 0) {
    int n = row_vecs;
    for (int width = 1; width < x; width *= 2) {
      for (int k = 0; k < n / 2; ++k) {
        store(part + k * kLanes, pair_sum(load(part + 2 * k * kLanes), load(part + (2 * k + 1) * kLanes)));
      }
      n /= 2;
    }
    for (int k = 0; k < n; ++k) store(logits + k * kLanes, load(part + k * kLanes));
    return;
  }
  for (int t = 0; t < block_size; ++t) {
    float logit = 0.0f;
    for (int j = 0; j < x; ++j) logit += part[t * x + j];
    logits[t] = logit;
  }
}

// The next group's K/V blocks, prefetched (into L2) during this group's PV: while PV walks
// its value blocks vector by vector, each line of the next blocks at the same byte offset
// is requested once, so the requests are spread evenly over the loop.
struct NextBlocks {
  const char* blocks[2 * kGroupBlocks] = {};
  int count = 0;
  int64_t elem_bytes = 0;  // element size of the next blocks
  void add(const void* block) { blocks[count++] = static_cast<const char*>(block); }
  // Called with the element index i of the value vector being processed.
  void prefetch(int64_t i) const {
    const int64_t byte = i * elem_bytes;
    if (byte % 64 != 0) return;
    for (int j = 0; j < count; ++j) VPAGE_PREFETCH_L2(blocks[j] + byte);
  }
};

// PV for rows [r0, r0 + N) over the nb value blocks of a group:
// acc[r][i] += sum_g v_g[i] * p[r][g][i mod ptile_len], accumulators in registers.
// ptile row r, block g starts at ptile + r * row_stride + g * ptile_len.
template <int N, typename T>
inline void pv_rows(const T* const* vblocks, int nb, const float* ptile, int64_t row_stride, float* acc, int r0,
                    int64_t block_elems, int ptile_len, const NextBlocks& next) {
  int pi = 0;
  for (int64_t i = 0; i < block_elems; i += kLanes) {
    next.prefetch(i);
    Vec a[N];
    for (int n = 0; n < N; ++n) a[n] = load(acc + (r0 + n) * block_elems + i);
    for (int g = 0; g < nb; ++g) {
      const Vec v = load(vblocks[g] + i);
      const float* p = ptile + r0 * row_stride + g * ptile_len + pi;
      for (int n = 0; n < N; ++n) a[n] = fma(v, load(p + n * row_stride), a[n]);
    }
    for (int n = 0; n < N; ++n) store(acc + (r0 + n) * block_elems + i, a[n]);
    pi += kLanes;
    if (pi == ptile_len) pi = 0;
  }
}

// pv_rows for a full group whose probability tiles are single vectors (ptile_len ==
// kLanes): the N x NB probability vectors are loaded once, before the loop.
template <int N, int NB, typename T>
inline void pv_rows_tile1(const T* const* vblocks, const float* ptile, int64_t row_stride, float* acc, int r0,
                          int64_t block_elems, const NextBlocks& next) {
  Vec p[N][NB];
  const T* vb[NB];
  for (int g = 0; g < NB; ++g) {
    vb[g] = vblocks[g];
    for (int n = 0; n < N; ++n) p[n][g] = load(ptile + (r0 + n) * row_stride + g * kLanes);
  }
  for (int64_t i = 0; i < block_elems; i += kLanes) {
    next.prefetch(i);
    Vec a[N];
    for (int n = 0; n < N; ++n) a[n] = load(acc + (r0 + n) * block_elems + i);
    for (int g = 0; g < NB; ++g) {
      const Vec v = load(vb[g] + i);
      for (int n = 0; n < N; ++n) a[n] = fma(v, p[n][g], a[n]);
    }
    for (int n = 0; n < N; ++n) store(acc + (r0 + n) * block_elems + i, a[n]);
  }
}

template <int N, typename T>
inline void pv_pass(const T* const* vblocks, int nb, const float* ptile, int64_t row_stride, float* acc, int r0,
                    int64_t block_elems, int ptile_len, const NextBlocks& next) {
  if (nb == kGroupBlocks && ptile_len == kLanes) {
    pv_rows_tile1<N, kGroupBlocks>(vblocks, ptile, row_stride, acc, r0, block_elems, next);
  } else {
    pv_rows<N>(vblocks, nb, ptile, row_stride, acc, r0, block_elems, ptile_len, next);
  }
}

// PV of a group in passes of up to kMaxPvRowsPerPass rows; the next group is prefetched
// during the first pass only.
template <typename T>
inline void pv_group(const T* const* vblocks, int nb, const float* ptile, int64_t row_stride, float* acc,
                     int rows, int64_t block_elems, int ptile_len, const NextBlocks& next) {
  const NextBlocks none;
  for (int r0 = 0; r0 < rows; r0 += kMaxPvRowsPerPass) {
    const NextBlocks& pf = r0 == 0 ? next : none;
    switch (rows - r0 < kMaxPvRowsPerPass ? rows - r0 : kMaxPvRowsPerPass) {
      case 1: pv_pass<1>(vblocks, nb, ptile, row_stride, acc, r0, block_elems, ptile_len, pf); break;
      case 2: pv_pass<2>(vblocks, nb, ptile, row_stride, acc, r0, block_elems, ptile_len, pf); break;
      case 3: pv_pass<3>(vblocks, nb, ptile, row_stride, acc, r0, block_elems, ptile_len, pf); break;
      default: pv_pass<kMaxPvRowsPerPass>(vblocks, nb, ptile, row_stride, acc, r0, block_elems, ptile_len, pf); break;
    }
  }
}

// T: the cache element, TQ: the query and output element (kv_dtypes_supported).
template <typename T, typename TQ>
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
  float* acc = scratch + s.acc;
  float* vtmp = scratch + s.vtmp;
  float* row_max = scratch + s.max;
  float* row_sum = scratch + s.sum;
  // Probabilities read by PV: the logits buffer itself when each block's probabilities
  // are already tiled (block_size a multiple of kLanes), else a tiled copy.
  const bool direct = bs % kLanes == 0;
  float* ptile = direct ? logits : scratch + s.ptile;
  const int64_t group_len = static_cast<int64_t>(kGroupBlocks) * s.logits_len;
  const int64_t ptile_row_stride = static_cast<int64_t>(kGroupBlocks) * s.ptile_len;

  // Queries, scaled, as repeated x-fragments: qrep[r][c][lane] = q[c*x + lane % x] * scale.
  const TQ* query = static_cast<const TQ*>(a.query);
  const Vec scale = set1(a.scale);
  for (int r = 0; r < rows; ++r) {
    const int q = r / task.num_heads;
    const int head = task.first_head + r % task.num_heads;
    const TQ* src = query + (task.first_query + q) * a.query_stride + static_cast<int64_t>(head) * hs;
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
  const int window = a.sliding_window;
  const float cap = a.logits_soft_cap;
  const int first_block = task.ctx_begin / bs;
  const int end_block = (task.ctx_end + bs - 1) / bs;
  for (int b0 = first_block; b0 < end_block; b0 += kGroupBlocks) {
    const int nb = end_block - b0 < kGroupBlocks ? end_block - b0 : kGroupBlocks;
    const T* vblocks[kGroupBlocks];
    NextBlocks next;
    next.elem_bytes = static_cast<int64_t>(sizeof(T));
    for (int b = b0 + kGroupBlocks; b < end_block && b < b0 + 2 * kGroupBlocks; ++b) {
      next.add(key_cache + table[b] * block_stride + head_offset);
      next.add(value_cache + table[b] * block_stride + head_offset);
    }

    // QK and logits of every block of the group, soft-capped, with the causal/context mask
    // and the window mask (non-empty only in the window's first block).
    for (int g = 0; g < nb; ++g) {
      const int64_t physical = table[b0 + g];
      const T* key_block = key_cache + physical * block_stride + head_offset;
      vblocks[g] = value_cache + physical * block_stride + head_offset;
      qk_block(key_block, qrep, part, rows, num_chunks, row_len, s.row_vecs);
      const int base = (b0 + g) * bs;
      for (int r = 0; r < rows; ++r) {
        float* row_logits = logits + r * group_len + g * s.logits_len;
        part_to_logits(part + static_cast<int64_t>(r) * s.row_vecs * kLanes, row_logits, x, bs, s.row_vecs);
        if (cap > 0.0f) {
          for (int t = 0; t < s.logits_len; t += kLanes) store(row_logits + t, soft_cap(load(row_logits + t), cap));
        }
        const int visible_end = task.first_visible_end + r / task.num_heads;
        const int end = visible_end < task.ctx_end ? visible_end : task.ctx_end;
        const int limit = end - base < bs ? end - base : bs;
        for (int t = limit > 0 ? limit : 0; t < s.logits_len; ++t) row_logits[t] = kNegInf;
        const int hidden = window > 0 ? visible_end - window - base : 0;  // tokens before the window
        for (int t = 0; t < hidden && t < bs; ++t) row_logits[t] = kNegInf;
      }
    }

    // Online softmax per row over the group.
    const int64_t used_len = static_cast<int64_t>(nb) * s.logits_len;
    for (int r = 0; r < rows; ++r) {
      float* row_logits = logits + r * group_len;
      Vec m = set1(kNegInf);
      for (int64_t t = 0; t < used_len; t += kLanes) m = max(m, load(row_logits + t));
      const float group_max = reduce_max(m);
      if (group_max > row_max[r]) {
        if (row_max[r] != kNegInf) {
          const float alpha = expf(row_max[r] - group_max);
          const Vec alpha_vec = set1(alpha);
          float* row_acc = acc + r * block_elems;
          for (int64_t i = 0; i < block_elems; i += kLanes) store(row_acc + i, mul(load(row_acc + i), alpha_vec));
          row_sum[r] *= alpha;
        }
        row_max[r] = group_max;
      }
      const Vec shift = set1(row_max[r] == kNegInf ? 0.0f : -row_max[r]);
      Vec sum = zero();
      for (int64_t t = 0; t < used_len; t += kLanes) {
        const Vec p = exp_nonpositive(add(load(row_logits + t), shift));
        store(row_logits + t, p);
        sum = add(sum, p);
      }
      row_sum[r] += reduce_add(sum);
      if (!direct) {
        for (int g = 0; g < nb; ++g) {
          float* row_ptile = ptile + r * ptile_row_stride + g * s.ptile_len;
          const float* probs = row_logits + g * s.logits_len;
          for (int i = 0; i < s.ptile_len; ++i) row_ptile[i] = probs[i % bs];
        }
      }
    }

    // PV: a partial last block is copied with its unwritten tokens zeroed (they may hold
    // NaN, and 0 * NaN would poison the accumulator).
    const int valid = task.ctx_end - (b0 + nb - 1) * bs;
    if (valid < bs) {
      const T* last = vblocks[nb - 1];
      for (int64_t i = 0; i < block_elems; i += kLanes) store(vtmp + i, load(last + i));
      for (int d = 0; d < hs; ++d) {
        for (int t = valid; t < bs; ++t) vtmp[static_cast<int64_t>(d) * bs + t] = 0.0f;
      }
      // Mixed types: the group's full blocks are T, the copied block fp32; run them apart.
      // (No next group here: the partial block is the last of the task.)
      if (nb > 1) pv_group(vblocks, nb - 1, ptile, ptile_row_stride, acc, rows, block_elems, s.ptile_len, next);
      const float* tmp_blocks[1] = {vtmp};
      pv_group(tmp_blocks, 1, ptile + (nb - 1) * s.ptile_len, ptile_row_stride, acc, rows, block_elems, s.ptile_len,
               next);
    } else {
      pv_group(vblocks, nb, ptile, ptile_row_stride, acc, rows, block_elems, s.ptile_len, next);
    }
  }
  // Sum the accumulator over tokens: o[d] = sum_t acc[d][t]. With block_size a multiple
  // of kLanes: the block_size / kLanes vectors of each d are added, then kLanes such sums
  // (consecutive d) are reduced to one vector of kLanes outputs by a pair_sum tree.
  for (int r = 0; r < rows; ++r) {
    const float* row_acc = acc + r * block_elems;
    float* o = vtmp;
    if (bs % kLanes == 0) {
      for (int d0 = 0; d0 < hs; d0 += kLanes) {
        Vec level[kLanes];
        for (int j = 0; j < kLanes; ++j) {
          const float* src = row_acc + static_cast<int64_t>(d0 + j) * bs;
          Vec sum = load(src);
          for (int t = kLanes; t < bs; t += kLanes) sum = add(sum, load(src + t));
          level[j] = sum;
        }
        for (int n = kLanes; n > 1; n /= 2) {
          for (int k = 0; k < n / 2; ++k) level[k] = pair_sum(level[2 * k], level[2 * k + 1]);
        }
        store(o + d0, level[0]);
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
      TQ* dst = static_cast<TQ*>(a.out) + ((task.first_query + q) * a.num_heads + head) * static_cast<int64_t>(hs);
      const Vec inv = set1(row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f);
      for (int d = 0; d < hs; d += kLanes) store(dst + d, mul(load(o + d), inv));
    }
  }
}

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE
