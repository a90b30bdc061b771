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
// run_task uses this kernel only for block sizes that are not a multiple of kLanes; the
// others take the register-blocked decode fast path further down (run_fast_task_typed).
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
  for (int b0 = first_block; b0 < end_block; b0 += kGroupBlocks) {
    const int nb = end_block - b0 < kGroupBlocks ? end_block - b0 : kGroupBlocks;
    const T* vblocks[kGroupBlocks];
    NextBlocks next;
    next.elem_bytes = static_cast<int64_t>(sizeof(T));
    for (int b = b0 + kGroupBlocks; b < end_block && b < b0 + 2 * kGroupBlocks; ++b) {
      next.add(key_cache + table[b] * block_stride + head_offset);
      next.add(value_cache + table[b] * block_stride + head_offset);
    }

    // QK and logits of every block of the group, with the causal/context mask.
    for (int g = 0; g < nb; ++g) {
      const int64_t physical = table[b0 + g];
      const T* key_block = key_cache + physical * block_stride + head_offset;
      vblocks[g] = value_cache + physical * block_stride + head_offset;
      qk_block(key_block, qrep, part, rows, num_chunks, row_len, s.row_vecs);
      const int base = (b0 + g) * bs;
      for (int r = 0; r < rows; ++r) {
        float* row_logits = logits + r * group_len + g * s.logits_len;
        part_to_logits(part + static_cast<int64_t>(r) * s.row_vecs * kLanes, row_logits, x, bs, s.row_vecs);
        const int visible_end = task.first_visible_end + r / task.num_heads;
        const int end = visible_end < task.ctx_end ? visible_end : task.ctx_end;
        const int limit = end - base < bs ? end - base : bs;
        for (int t = limit > 0 ? limit : 0; t < s.logits_len; ++t) row_logits[t] = kNegInf;
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
      T* dst = static_cast<T*>(a.out) + ((task.first_query + q) * a.num_heads + head) * static_cast<int64_t>(hs);
      const Vec inv = set1(row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f);
      for (int d = 0; d < hs; d += kLanes) store(dst + d, mul(load(o + d), inv));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Decode fast path (block_size a multiple of kLanes). Same reading order as above (QK,
// online softmax and PV per group of blocks, each K/V block read once for all rows), but
// the inner loops are register-blocked so that they are load/FMA bound for small row
// counts (R = 1..4 rows per pass; more rows run in passes of kFastRowsPerPass):
//   QK: acc[R][V] of V consecutive key vectors (kLanes/x tokens x x dims each) over the
//       hs/x chunks, the repeated query fragments loaded once per chunk and row; the
//       partial sums are reduced to logits by a pair_sum tree in registers (any levels
//       left when V < x run over a small per-row buffer).
//   softmax: online per group of kFastGroupTokens tokens; rescaling of the accumulator by
//       alpha is folded into PV's accumulator load (only when some row's max grew).
//   PV: tokens in lanes: acc[r][d][lane] += V(d, t0 + lane) * p[r][t0 + lane], for D
//       consecutive dims at a time over every token of the group (probability vectors are
//       the logits buffer itself, no tiling); acc is [R][hs][kLanes], summed over lanes
//       once per task.
// Scratch: qrep [R][hs/x][kLanes], logits [R][group tokens], part [R][row_vecs][kLanes],
// acc [R][hs][kLanes], tmp [hs] (scaled query, output row), max, sum, alpha [R].

constexpr int kFastRowsPerPass = 4;
constexpr int kFastGroupTokens = 64;  // tokens per softmax/PV group (>= one block)
constexpr int kFastMaxGroupBlocks = kFastGroupTokens / kLanes > 1 ? kFastGroupTokens / kLanes : 1;
constexpr int kVecRegs = kLanes == 16 ? 32 : 16;  // SIMD registers of the ISA

// Register tile width for R rows: the largest power of two T <= 8 with R*T accumulators,
// R row operands and one K/V vector in registers.
template <int R>
constexpr int fast_tile() {
  int t = 8;
  while (t > 1 && R * t + R + 1 > kVecRegs) t /= 2;
  return t;
}

constexpr int ilog2(int v) { return v <= 1 ? 0 : 1 + ilog2(v / 2); }

inline int fast_group_blocks(int32_t block_size) {
  const int g = kFastGroupTokens / block_size;
  return g < 1 ? 1 : g;
}

struct FastScratch {
  int64_t qrep, logits, part, acc, tmp, max, sum, alpha, total;
  int group_tokens, row_vecs;
  FastScratch(int32_t rows, int32_t head_size, int32_t block_size, int x) {
    group_tokens = fast_group_blocks(block_size) * block_size;
    row_vecs = static_cast<int>(static_cast<int64_t>(block_size) * x / kLanes);
    qrep = 0;
    logits = qrep + static_cast<int64_t>(rows) * (head_size / x) * kLanes;
    part = logits + static_cast<int64_t>(rows) * round_up(group_tokens, kLanes);
    acc = part + static_cast<int64_t>(rows) * row_vecs * kLanes;
    tmp = acc + static_cast<int64_t>(rows) * head_size * kLanes;
    max = tmp + round_up(head_size, kLanes);
    sum = max + round_up(rows, kLanes);
    alpha = sum + round_up(rows, kLanes);
    total = alpha + round_up(rows, kLanes);
  }
};

inline int64_t fast_scratch_floats(int32_t rows, int32_t head_size, int32_t block_size) {
  const int64_t fp32 = FastScratch(rows, head_size, block_size, 4).total;
  const int64_t half = FastScratch(rows, head_size, block_size, 8).total;
  return fp32 > half ? fp32 : half;
}

// QK of key vectors [v0, v0 + V) of one block row for R rows. The V accumulators of a row
// are reduced by min(V, x) levels of pair_sum to V / min(V, x) vectors, stored at
// out + r * out_stride + (v0 / min(V, x)) * kLanes (in token order).
template <int R, int V, typename T>
inline void fast_qk_tile(const T* key_block, const float* qrep, int64_t q_stride, float* out, int64_t out_stride,
                         int num_chunks, int row_len, int v0) {
  constexpr int x = 16 / static_cast<int>(sizeof(T));
  constexpr int kReduce = V < x ? V : x;
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = zero();
  const T* src = key_block + static_cast<int64_t>(v0) * kLanes;
  for (int c = 0; c < num_chunks; ++c) {
    Vec q[R];
    for (int r = 0; r < R; ++r) q[r] = load(qrep + r * q_stride + c * kLanes);
    for (int v = 0; v < V; ++v) {
      const Vec k = load(src + v * kLanes);
      for (int r = 0; r < R; ++r) acc[r][v] = fma(k, q[r], acc[r][v]);
    }
    src += row_len;
  }
  for (int r = 0; r < R; ++r) {
    int n = V;
    for (int level = 0; level < ilog2(kReduce); ++level) {
      for (int k = 0; k < n / 2; ++k) acc[r][k] = pair_sum(acc[r][2 * k], acc[r][2 * k + 1]);
      n /= 2;
    }
    float* dst = out + r * out_stride + (v0 / kReduce) * kLanes;
    for (int k = 0; k < V / kReduce; ++k) store(dst + k * kLanes, acc[r][k]);
  }
}

// QK logits of one block for R rows: logits[r * logits_stride + t], t < block_size.
template <int R, int V, typename T>
inline void fast_qk_block_v(const T* key_block, const float* qrep, int64_t q_stride, float* logits,
                            int64_t logits_stride, float* part, int64_t part_stride, int num_chunks, int row_len,
                            int row_vecs) {
  constexpr int x = 16 / static_cast<int>(sizeof(T));
  constexpr int kReduce = V < x ? V : x;
  constexpr int kLeft = ilog2(x) - ilog2(kReduce);  // pair_sum levels left after the tiles
  float* out = kLeft == 0 ? logits : part;
  const int64_t out_stride = kLeft == 0 ? logits_stride : part_stride;
  for (int v0 = 0; v0 < row_vecs; v0 += V) {
    fast_qk_tile<R, V>(key_block, qrep, q_stride, out, out_stride, num_chunks, row_len, v0);
  }
  if (kLeft > 0) {
    for (int r = 0; r < R; ++r) {
      float* p = part + r * part_stride;
      int n = row_vecs / kReduce;
      for (int level = 0; level < kLeft; ++level) {
        for (int k = 0; k < n / 2; ++k) {
          store(p + k * kLanes, pair_sum(load(p + 2 * k * kLanes), load(p + (2 * k + 1) * kLanes)));
        }
        n /= 2;
      }
      for (int k = 0; k < n; ++k) store(logits + r * logits_stride + k * kLanes, load(p + k * kLanes));
    }
  }
}

template <int R, typename T>
inline void fast_qk_block(const T* key_block, const float* qrep, int64_t q_stride, float* logits,
                          int64_t logits_stride, float* part, int64_t part_stride, int num_chunks, int row_len,
                          int row_vecs) {
  // row_vecs = (block_size / kLanes) * x is a multiple of x >= 4: the tile (<= 8) or its
  // half divides it.
  constexpr int kTile = fast_tile<R>();
  if (row_vecs % kTile == 0) {
    fast_qk_block_v<R, kTile>(key_block, qrep, q_stride, logits, logits_stride, part, part_stride, num_chunks,
                              row_len, row_vecs);
  } else if (kTile > 1 && row_vecs % (kTile > 1 ? kTile / 2 : 1) == 0) {
    fast_qk_block_v<R, (kTile > 1 ? kTile / 2 : 1)>(key_block, qrep, q_stride, logits, logits_stride, part,
                                                    part_stride, num_chunks, row_len, row_vecs);
  } else {
    fast_qk_block_v<R, 1>(key_block, qrep, q_stride, logits, logits_stride, part, part_stride, num_chunks, row_len,
                          row_vecs);
  }
}

// Prefetch (into L2) of the next group's K/V blocks, spread over PV: the call for dims
// [d0, d0 + D) requests the lines of the same byte range of every next block.
struct FastPrefetch {
  const char* blocks[2 * kFastMaxGroupBlocks];  // the first count are set
  int count = 0;
  int64_t row_bytes = 0;  // bytes of one value dim row (block_size elements)
  void add(const void* block) { blocks[count++] = static_cast<const char*>(block); }
  void range(int d0, int dims) const {
    const int64_t begin = d0 * row_bytes, end = (d0 + dims) * row_bytes;
    for (int j = 0; j < count; ++j) {
      for (int64_t b = begin; b < end; b += 64) VPAGE_PREFETCH_L2(blocks[j] + b);
    }
  }
};

// How fast_pv starts its accumulators: from scratch, scaled by alpha, or from zero.
enum class AccInit { kLoad, kScale, kZero };

// PV of R rows over nb value blocks of TV * kLanes tokens:
//   acc[r][d][lane] = init(acc[r][d][lane]) + sum over tokens t = t0 + lane of V(d, t) * p[r][t],
// init = identity, * alpha[r] or 0 (Init). With Masked, only the first last_valid tokens of
// the last block are read (the others may hold NaN; their probabilities are 0).
// probs: row r, block g at probs + r * probs_stride + g * TV * kLanes.
template <int R, int D, int TV, AccInit Init, bool Masked, typename T>
inline void fast_pv(const T* const* vblocks, int nb, const float* probs, int64_t probs_stride, float* acc,
                    int64_t acc_stride, const float* alpha, int hs, int last_valid, const FastPrefetch* prefetch) {
  constexpr int bs = TV * kLanes;
  Vec scale[R];
  if (Init == AccInit::kScale) {
    for (int r = 0; r < R; ++r) scale[r] = set1(alpha[r]);
  }
  const int nb_full = Masked ? nb - 1 : nb;
  for (int d0 = 0; d0 < hs; d0 += D) {
    if (prefetch != nullptr) prefetch->range(d0, D);
    Vec a[R][D];
    for (int r = 0; r < R; ++r) {
      for (int d = 0; d < D; ++d) {
        if (Init == AccInit::kZero) {
          a[r][d] = zero();
        } else {
          a[r][d] = load(acc + r * acc_stride + (d0 + d) * kLanes);
          if (Init == AccInit::kScale) a[r][d] = mul(a[r][d], scale[r]);
        }
      }
    }
    const float* pg = probs;
    for (int g = 0; g < nb_full; ++g, pg += bs) {
      const T* vb = vblocks[g] + static_cast<int64_t>(d0) * bs;
      for (int t = 0; t < bs; t += kLanes) {
        Vec p[R];
        for (int r = 0; r < R; ++r) p[r] = load(pg + r * probs_stride + t);
        for (int d = 0; d < D; ++d) {
          const Vec v = load(vb + d * bs + t);
          for (int r = 0; r < R; ++r) a[r][d] = fma(v, p[r], a[r][d]);
        }
      }
    }
    if (Masked) {
      const T* vb = vblocks[nb_full] + static_cast<int64_t>(d0) * bs;
      for (int t = 0; t < last_valid; t += kLanes) {
        Vec p[R];
        for (int r = 0; r < R; ++r) p[r] = load(pg + r * probs_stride + t);
        for (int d = 0; d < D; ++d) {
          const Vec v = keep_first(load(vb + d * bs + t), last_valid - t < kLanes ? last_valid - t : kLanes);
          for (int r = 0; r < R; ++r) a[r][d] = fma(v, p[r], a[r][d]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < D; ++d) store(acc + r * acc_stride + (d0 + d) * kLanes, a[r][d]);
  }
}

template <int R, int TV, typename T>
inline void fast_pv_tv(const T* const* vblocks, int nb, const float* probs, int64_t probs_stride, float* acc,
                       int64_t acc_stride, const float* alpha, AccInit init, int hs, int last_valid,
                       const FastPrefetch* prefetch) {
  constexpr int kD = fast_tile<R>();
  const bool masked = last_valid < TV * kLanes;
#define VPAGE_FAST_PV(INIT, MASKED)                                                                           \
  fast_pv<R, kD, TV, INIT, MASKED>(vblocks, nb, probs, probs_stride, acc, acc_stride, alpha, hs, last_valid, \
                                   prefetch)
  switch (init) {
    case AccInit::kLoad: masked ? VPAGE_FAST_PV(AccInit::kLoad, true) : VPAGE_FAST_PV(AccInit::kLoad, false); break;
    case AccInit::kScale: masked ? VPAGE_FAST_PV(AccInit::kScale, true) : VPAGE_FAST_PV(AccInit::kScale, false); break;
    case AccInit::kZero: masked ? VPAGE_FAST_PV(AccInit::kZero, true) : VPAGE_FAST_PV(AccInit::kZero, false); break;
  }
#undef VPAGE_FAST_PV
}

// fast_pv for block sizes of 1, 2, 4 or 8 vectors (compile-time token loops).
template <int R, typename T>
inline void fast_pv_rows(const T* const* vblocks, int nb, const float* probs, int64_t probs_stride, float* acc,
                         int64_t acc_stride, const float* alpha, AccInit init, int hs, int bs, int last_valid,
                         const FastPrefetch* prefetch) {
  switch (bs / kLanes) {
    case 1: fast_pv_tv<R, 1>(vblocks, nb, probs, probs_stride, acc, acc_stride, alpha, init, hs, last_valid, prefetch); break;
    case 2: fast_pv_tv<R, 2>(vblocks, nb, probs, probs_stride, acc, acc_stride, alpha, init, hs, last_valid, prefetch); break;
    case 4: fast_pv_tv<R, 4>(vblocks, nb, probs, probs_stride, acc, acc_stride, alpha, init, hs, last_valid, prefetch); break;
    default: fast_pv_tv<R, 8>(vblocks, nb, probs, probs_stride, acc, acc_stride, alpha, init, hs, last_valid, prefetch); break;
  }
}

// Calls fn(std::integral_constant-like R) for passes of up to kFastRowsPerPass rows.
template <typename Fn>
inline void for_row_passes(int rows, Fn&& fn) {
  for (int r0 = 0; r0 < rows; r0 += kFastRowsPerPass) {
    const int n = rows - r0 < kFastRowsPerPass ? rows - r0 : kFastRowsPerPass;
    fn(r0, n);
  }
}

template <typename T>
void run_fast_task_typed(const PagedAttentionArgs& a, const AttentionTask& task, float* scratch) {
  static_assert(kFastRowsPerPass == 4, "the row-pass switches below handle 1..4 rows");
  constexpr int x = 16 / static_cast<int>(sizeof(T));
  const int hs = a.cache.head_size;
  const int bs = a.cache.block_size;
  const int num_chunks = hs / x;
  const int row_len = bs * x;
  const int64_t block_elems = static_cast<int64_t>(hs) * bs;
  const int rows = task.num_queries * task.num_heads;
  const FastScratch s(rows, hs, bs, x);
  float* qrep = scratch + s.qrep;
  float* logits = scratch + s.logits;
  float* part = scratch + s.part;
  float* acc = scratch + s.acc;
  float* tmp = scratch + s.tmp;
  float* row_max = scratch + s.max;
  float* row_sum = scratch + s.sum;
  float* alpha = scratch + s.alpha;
  const int64_t q_stride = static_cast<int64_t>(num_chunks) * kLanes;
  const int64_t logits_stride = round_up(s.group_tokens, kLanes);
  const int64_t part_stride = static_cast<int64_t>(s.row_vecs) * kLanes;
  const int64_t acc_stride = static_cast<int64_t>(hs) * kLanes;

  // Queries, scaled, as repeated x-fragments: qrep[r][c][lane] = q[c*x + lane % x] * scale.
  const T* query = static_cast<const T*>(a.query);
  const Vec scale = set1(a.scale);
  for (int r = 0; r < rows; ++r) {
    const int q = r / task.num_heads;
    const int head = task.first_head + r % task.num_heads;
    const T* src = query + (task.first_query + q) * a.query_stride + static_cast<int64_t>(head) * hs;
    float* dst = qrep + r * q_stride;
    if (x == kLanes) {
      for (int d = 0; d < hs; d += kLanes) store(dst + d, mul(load(src + d), scale));
    } else {
      float* scaled = tmp;
      for (int d = 0; d < hs; d += kLanes) store(scaled + d, mul(load(src + d), scale));
      for (int c = 0; c < num_chunks; ++c) {
        for (int lane = 0; lane < kLanes; ++lane) dst[c * kLanes + lane] = scaled[c * x + lane % x];
      }
    }
    row_max[r] = kNegInf;
    row_sum[r] = 0.0f;
  }

  const T* key_cache = static_cast<const T*>(a.key_cache);
  const T* value_cache = static_cast<const T*>(a.value_cache);
  const int32_t* table = a.block_tables + static_cast<int64_t>(task.seq) * a.max_blocks_per_seq;
  const int64_t head_offset = static_cast<int64_t>(task.kv_head) * block_elems;
  const int64_t block_stride = static_cast<int64_t>(a.cache.num_kv_heads) * block_elems;
  const int group_blocks = fast_group_blocks(bs);
  const int first_block = task.ctx_begin / bs;
  const int end_block = (task.ctx_end + bs - 1) / bs;
  for (int b0 = first_block; b0 < end_block; b0 += group_blocks) {
    const int nb = end_block - b0 < group_blocks ? end_block - b0 : group_blocks;
    const T* vblocks[kFastMaxGroupBlocks];
    FastPrefetch next;
    next.row_bytes = static_cast<int64_t>(bs) * sizeof(T);
    for (int b = b0 + group_blocks; b < end_block && b < b0 + 2 * group_blocks; ++b) {
      next.add(key_cache + table[b] * block_stride + head_offset);
      next.add(value_cache + table[b] * block_stride + head_offset);
    }

    // QK of every block of the group, then the causal/context mask.
    for (int g = 0; g < nb; ++g) {
      const int64_t physical = table[b0 + g];
      const T* key_block = key_cache + physical * block_stride + head_offset;
      vblocks[g] = value_cache + physical * block_stride + head_offset;
      for_row_passes(rows, [&](int r0, int n) {
        const float* q = qrep + r0 * q_stride;
        float* lg = logits + r0 * logits_stride + g * bs;
        switch (n) {
          case 1: fast_qk_block<1>(key_block, q, q_stride, lg, logits_stride, part, part_stride, num_chunks, row_len, s.row_vecs); break;
          case 2: fast_qk_block<2>(key_block, q, q_stride, lg, logits_stride, part, part_stride, num_chunks, row_len, s.row_vecs); break;
          case 3: fast_qk_block<3>(key_block, q, q_stride, lg, logits_stride, part, part_stride, num_chunks, row_len, s.row_vecs); break;
          default: fast_qk_block<4>(key_block, q, q_stride, lg, logits_stride, part, part_stride, num_chunks, row_len, s.row_vecs); break;
        }
      });
    }
    const int base = b0 * bs;
    const int group_len = nb * bs;

    // Online softmax per row over the group.
    bool rescale = false;
    for (int r = 0; r < rows; ++r) {
      float* row_logits = logits + r * logits_stride;
      const int visible_end = task.first_visible_end + r / task.num_heads;
      const int end = visible_end < task.ctx_end ? visible_end : task.ctx_end;
      const int limit = end - base < group_len ? end - base : group_len;
      for (int t = limit > 0 ? limit : 0; t < group_len; ++t) row_logits[t] = kNegInf;
      Vec m = set1(kNegInf);
      for (int t = 0; t < group_len; t += kLanes) m = max(m, load(row_logits + t));
      const float group_max = reduce_max(m);
      alpha[r] = 1.0f;
      if (group_max > row_max[r]) {
        if (row_max[r] != kNegInf) {
          alpha[r] = expf(row_max[r] - group_max);
          row_sum[r] *= alpha[r];
          rescale = true;
        }
        row_max[r] = group_max;
      }
      const Vec shift = set1(row_max[r] == kNegInf ? 0.0f : -row_max[r]);
      Vec sum = zero();
      for (int t = 0; t < group_len; t += kLanes) {
        const Vec p = exp_nonpositive(add(load(row_logits + t), shift));
        store(row_logits + t, p);
        sum = add(sum, p);
      }
      row_sum[r] += reduce_add(sum);
    }

    // PV; the unwritten tokens of a partial last block are masked (they may hold NaN, and
    // 0 * NaN would poison the accumulator).
    const int valid = task.ctx_end - (b0 + nb - 1) * bs;
    const int last_valid = valid < bs ? valid : bs;
    const AccInit init = b0 == first_block ? AccInit::kZero : rescale ? AccInit::kScale : AccInit::kLoad;
    const FastPrefetch* pf = next.count > 0 ? &next : nullptr;
    for_row_passes(rows, [&](int r0, int n) {
      const float* p = logits + r0 * logits_stride;
      float* ac = acc + r0 * acc_stride;
      const float* al = alpha + r0;
      const FastPrefetch* pfr = r0 == 0 ? pf : nullptr;
      switch (n) {
        case 1: fast_pv_rows<1>(vblocks, nb, p, logits_stride, ac, acc_stride, al, init, hs, bs, last_valid, pfr); break;
        case 2: fast_pv_rows<2>(vblocks, nb, p, logits_stride, ac, acc_stride, al, init, hs, bs, last_valid, pfr); break;
        case 3: fast_pv_rows<3>(vblocks, nb, p, logits_stride, ac, acc_stride, al, init, hs, bs, last_valid, pfr); break;
        default: fast_pv_rows<4>(vblocks, nb, p, logits_stride, ac, acc_stride, al, init, hs, bs, last_valid, pfr); break;
      }
    });
  }
  if (end_block <= first_block) {
    for (int64_t i = 0; i < rows * acc_stride; i += kLanes) store(acc + i, zero());
  }

  // o[r][d] = sum over lanes of acc[r][d]: kLanes consecutive dims reduced to one vector
  // by a pair_sum tree.
  for (int r = 0; r < rows; ++r) {
    const float* row_acc = acc + r * acc_stride;
    float* o = tmp;
    for (int d0 = 0; d0 < hs; d0 += kLanes) {
      Vec level[kLanes];
      for (int j = 0; j < kLanes; ++j) level[j] = load(row_acc + (d0 + j) * kLanes);
      for (int n = kLanes; n > 1; n /= 2) {
        for (int k = 0; k < n / 2; ++k) level[k] = pair_sum(level[2 * k], level[2 * k + 1]);
      }
      store(o + d0, level[0]);
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

/// Whether the decode fast path handles this block size (token vectors never straddle blocks).
inline bool fast_path(int32_t block_size) {
  return block_size % kLanes == 0 && (block_size / kLanes) <= 8 && ((block_size / kLanes) & (block_size / kLanes - 1)) == 0;
}

inline int64_t decode_scratch_floats(int32_t rows, int32_t head_size, int32_t block_size) {
  const int64_t old_path = scratch_floats(rows, head_size, block_size);
  if (!fast_path(block_size)) return old_path;
  const int64_t fast = fast_scratch_floats(rows, head_size, block_size);
  return fast > old_path ? fast : old_path;
}

inline void run_task(const PagedAttentionArgs& args, const AttentionTask& task, float* scratch) {
  const bool fast = fast_path(args.cache.block_size);
  switch (args.cache.dtype) {
    case DType::kFloat32:
      fast ? run_fast_task_typed<float>(args, task, scratch) : run_task_typed<float>(args, task, scratch);
      break;
    case DType::kFloat16:
      fast ? run_fast_task_typed<F16>(args, task, scratch) : run_task_typed<F16>(args, task, scratch);
      break;
    case DType::kBFloat16:
      fast ? run_fast_task_typed<BF16>(args, task, scratch) : run_task_typed<BF16>(args, task, scratch);
      break;
  }
}

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE
