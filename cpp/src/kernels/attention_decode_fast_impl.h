// The CPU paged attention decode fast path and the decode entry points (run_task,
// decode_scratch_floats) that choose between it and the general task kernel of
// attention_impl.h, on whose helpers it builds. Compiled once per instruction set like it.
#pragma once

#include <type_traits>

#include "attention_impl.h"

namespace vpage::cpu::VPAGE_ISA_NAMESPACE {

// Decode fast path (block_size a multiple of kLanes). Same reading order as run_task_typed (QK,
// online softmax and PV per group of blocks, each K/V block read once for all rows), but
// the inner loops are register-blocked so that they are load/FMA bound for small row
// counts (R = 1..4 rows per pass; more rows run in passes of kFastRowsPerPass):
//   QK: acc[R][V] of V consecutive key vectors (kLanes/x tokens x x dims each) over the
//       hs/x chunks, the repeated query fragments loaded once per chunk and row; the
//       partial sums are reduced to logits by a pair_sum tree in registers (any levels
//       left when V < x run over a small per-row buffer). With AVX512-BF16, bfloat16 queries
//       over a bfloat16 cache take bf16 dot products instead (dot_qk_block).
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
// next_key (nullptr: none): a key block of the next group, fetched into L2 a chunk's bytes
// per chunk, so that its DRAM reads overlap this QK rather than only PV (FastPrefetch).
template <int R, int V, typename T>
inline void fast_qk_tile(const T* key_block, const float* qrep, int64_t q_stride, float* out, int64_t out_stride,
                         int num_chunks, int row_len, int v0, const T* next_key) {
  constexpr int x = 16 / static_cast<int>(sizeof(T));
  constexpr int kReduce = V < x ? V : x;
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = zero();
  const T* src = key_block + static_cast<int64_t>(v0) * kLanes;
  const int64_t chunk_bytes = static_cast<int64_t>(row_len) * sizeof(T);
  for (int c = 0; c < num_chunks; ++c) {
    if (next_key != nullptr) {
      const char* chunk = reinterpret_cast<const char*>(next_key) + c * chunk_bytes;
      for (int64_t b = 0; b < chunk_bytes; b += 64) VPAGE_PREFETCH_L2(chunk + b);
    }
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

// QK logits of one block for R rows: logits[r * logits_stride + t], t < block_size. The
// first tile fetches next_key (fast_qk_tile).
template <int R, int V, typename T>
inline void fast_qk_block_v(const T* key_block, const float* qrep, int64_t q_stride, float* logits,
                            int64_t logits_stride, float* part, int64_t part_stride, int num_chunks, int row_len,
                            int row_vecs, const T* next_key) {
  constexpr int x = 16 / static_cast<int>(sizeof(T));
  constexpr int kReduce = V < x ? V : x;
  constexpr int kLeft = ilog2(x) - ilog2(kReduce);  // pair_sum levels left after the tiles
  float* out = kLeft == 0 ? logits : part;
  const int64_t out_stride = kLeft == 0 ? logits_stride : part_stride;
  for (int v0 = 0; v0 < row_vecs; v0 += V) {
    fast_qk_tile<R, V>(key_block, qrep, q_stride, out, out_stride, num_chunks, row_len, v0,
                       v0 == 0 ? next_key : nullptr);
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
                          int row_vecs, const T* next_key) {
  // row_vecs = (block_size / kLanes) * x is a multiple of x >= 4: the tile (<= 8) or its
  // half divides it.
  constexpr int kTile = fast_tile<R>();
  if (row_vecs % kTile == 0) {
    fast_qk_block_v<R, kTile>(key_block, qrep, q_stride, logits, logits_stride, part, part_stride, num_chunks,
                              row_len, row_vecs, next_key);
  } else if (kTile > 1 && row_vecs % (kTile > 1 ? kTile / 2 : 1) == 0) {
    fast_qk_block_v<R, (kTile > 1 ? kTile / 2 : 1)>(key_block, qrep, q_stride, logits, logits_stride, part,
                                                    part_stride, num_chunks, row_len, row_vecs, next_key);
  } else {
    fast_qk_block_v<R, 1>(key_block, qrep, q_stride, logits, logits_stride, part, part_stride, num_chunks, row_len,
                          row_vecs, next_key);
  }
}

#if defined(__AVX512BF16__)
// QK of one block by bf16 dot products (the avx512bf16 build: bfloat16 queries over a bfloat16
// cache; no widening, half the instructions of fast_qk_block). A 64-byte key vector holds 4
// tokens x 8 dims (x = 8) of one chunk; vdpbf16ps with the row's 8 query values of that chunk
// repeated 4 times adds to each float32 lane one token's two products of a dim pair (exact
// products: 8-bit significands). After the hs/x chunks two pair_sum levels turn a token's 4
// lanes into its logit, then * scale (the query is read unscaled, as stored): the same logits
// as fast_qk_block up to float32 rounding. Tiles of 16 tokens, R x 4 accumulators; next_key as
// in fast_qk_tile.
template <int R>
inline void dot_qk_block(const BF16* key_block, const BF16* const* q_rows, float scale, float* logits,
                         int64_t logits_stride, int num_chunks, int row_len, int bs, const BF16* next_key) {
  constexpr int kTileTokens = 16, kTileVecs = 4;  // 4 tokens per 64-byte vector
  const int64_t chunk_bytes = static_cast<int64_t>(row_len) * sizeof(BF16);
  const Vec s = set1(scale);
  for (int t0 = 0; t0 < bs; t0 += kTileTokens) {
    __m512 acc[R][kTileVecs];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kTileVecs; ++v) acc[r][v] = _mm512_setzero_ps();
    const BF16* src = key_block + static_cast<int64_t>(t0) * 8;
    for (int c = 0; c < num_chunks; ++c) {
      if (t0 == 0 && next_key != nullptr) {
        const char* chunk = reinterpret_cast<const char*>(next_key) + c * chunk_bytes;
        for (int64_t b = 0; b < chunk_bytes; b += 64) VPAGE_PREFETCH_L2(chunk + b);
      }
      __m512bh q[R];
      for (int r = 0; r < R; ++r) {
        q[r] = reinterpret_cast<__m512bh>(
            _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q_rows[r] + c * 8))));
      }
      for (int v = 0; v < kTileVecs; ++v) {
        const __m512bh k = reinterpret_cast<__m512bh>(_mm512_loadu_si512(src + v * 32));
        for (int r = 0; r < R; ++r) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], k, q[r]);
      }
      src += row_len;
    }
    for (int r = 0; r < R; ++r) {
      const Vec low = pair_sum({acc[r][0]}, {acc[r][1]}), high = pair_sum({acc[r][2]}, {acc[r][3]});
      store(logits + r * logits_stride + t0, mul(pair_sum(low, high), s));
    }
  }
}
#endif

// Prefetch (into L2) of the next group's V blocks, spread over PV: the call for dims
// [d0, d0 + D) requests the lines of the same byte range of every next block. The next
// group's K blocks are fetched during this group's QK (fast_qk_tile): fetched here with the
// values, they came too late for the next QK, which then cost 5-18% more.
struct FastPrefetch {
  const char* blocks[kFastMaxGroupBlocks];  // the first count are set
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

// T: the cache element, TQ: the query and output element.
template <typename T, typename TQ>
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

#if defined(__AVX512BF16__)
  constexpr bool kDotQk = std::is_same_v<T, BF16> && std::is_same_v<TQ, BF16>;
#else
  constexpr bool kDotQk = false;
#endif
  // Queries, scaled, as repeated x-fragments: qrep[r][c][lane] = q[c*x + lane % x] * scale
  // (not for dot_qk_block, which reads the queries as they are).
  const TQ* query = static_cast<const TQ*>(a.query);
  const auto query_row = [&](int r) {
    return query + (task.first_query + r / task.num_heads) * a.query_stride +
           static_cast<int64_t>(task.first_head + r % task.num_heads) * hs;
  };
  const Vec scale = set1(a.scale);
  for (int r = 0; r < rows; ++r) {
    row_max[r] = kNegInf;
    row_sum[r] = 0.0f;
    if (kDotQk) continue;
    const TQ* src = query_row(r);
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
  }

  const T* key_cache = static_cast<const T*>(a.key_cache);
  const T* value_cache = static_cast<const T*>(a.value_cache);
  const int32_t* table = a.block_tables + static_cast<int64_t>(task.seq) * a.max_blocks_per_seq;
  const int64_t head_offset = static_cast<int64_t>(task.kv_head) * block_elems;
  const int64_t block_stride = static_cast<int64_t>(a.cache.num_kv_heads) * block_elems;
  const int group_blocks = fast_group_blocks(bs);
  const int window = a.sliding_window;
  const float cap = a.logits_soft_cap;
  const int first_block = task.ctx_begin / bs;
  const int end_block = (task.ctx_end + bs - 1) / bs;
  // The last group fetches the first group of the task this thread likely runs next (the
  // first group of a task was otherwise read cold, a quarter of a 256-token context).
  const AttentionTask* next_task = task.next;
  const int32_t* next_table =
      next_task != nullptr ? a.block_tables + static_cast<int64_t>(next_task->seq) * a.max_blocks_per_seq : nullptr;
  const int next_first = next_task != nullptr ? next_task->ctx_begin / bs : 0;
  const int next_count =
      next_task != nullptr ? std::min(group_blocks, (next_task->ctx_end + bs - 1) / bs - next_first) : 0;
  const int64_t next_head = next_task != nullptr ? static_cast<int64_t>(next_task->kv_head) * block_elems : 0;
  for (int b0 = first_block; b0 < end_block; b0 += group_blocks) {
    const int nb = end_block - b0 < group_blocks ? end_block - b0 : group_blocks;
    const bool last_group = b0 + group_blocks >= end_block;
    const T* vblocks[kFastMaxGroupBlocks];
    FastPrefetch next;
    next.row_bytes = static_cast<int64_t>(bs) * sizeof(T);
    for (int b = b0 + group_blocks; b < end_block && b < b0 + 2 * group_blocks; ++b) {
      next.add(value_cache + table[b] * block_stride + head_offset);
    }
    if (last_group) {
      for (int g = 0; g < next_count; ++g) {
        next.add(value_cache + next_table[next_first + g] * block_stride + next_head);
      }
    }

    // QK of every block of the group, then the causal/context mask.
    for (int g = 0; g < nb; ++g) {
      const int64_t physical = table[b0 + g];
      const T* key_block = key_cache + physical * block_stride + head_offset;
      vblocks[g] = value_cache + physical * block_stride + head_offset;
      const int next_block = b0 + group_blocks + g;  // its counterpart in the next group
      const T* next_key = next_block < end_block ? key_cache + table[next_block] * block_stride + head_offset
                          : last_group && g < next_count
                              ? key_cache + next_table[next_first + g] * block_stride + next_head
                              : nullptr;
      for_row_passes(rows, [&](int r0, int n) {
        const float* q = qrep + r0 * q_stride;
        float* lg = logits + r0 * logits_stride + g * bs;
        const T* nk = r0 == 0 ? next_key : nullptr;
#if defined(__AVX512BF16__)
        if constexpr (kDotQk) {
          const BF16* q_rows[kFastRowsPerPass];
          for (int r = 0; r < n; ++r) q_rows[r] = query_row(r0 + r);
          switch (n) {
            case 1: dot_qk_block<1>(key_block, q_rows, a.scale, lg, logits_stride, num_chunks, row_len, bs, nk); break;
            case 2: dot_qk_block<2>(key_block, q_rows, a.scale, lg, logits_stride, num_chunks, row_len, bs, nk); break;
            case 3: dot_qk_block<3>(key_block, q_rows, a.scale, lg, logits_stride, num_chunks, row_len, bs, nk); break;
            default: dot_qk_block<4>(key_block, q_rows, a.scale, lg, logits_stride, num_chunks, row_len, bs, nk); break;
          }
          return;
        }
#endif
        switch (n) {
          case 1: fast_qk_block<1>(key_block, q, q_stride, lg, logits_stride, part, part_stride, num_chunks, row_len, s.row_vecs, nk); break;
          case 2: fast_qk_block<2>(key_block, q, q_stride, lg, logits_stride, part, part_stride, num_chunks, row_len, s.row_vecs, nk); break;
          case 3: fast_qk_block<3>(key_block, q, q_stride, lg, logits_stride, part, part_stride, num_chunks, row_len, s.row_vecs, nk); break;
          default: fast_qk_block<4>(key_block, q, q_stride, lg, logits_stride, part, part_stride, num_chunks, row_len, s.row_vecs, nk); break;
        }
      });
    }
    const int base = b0 * bs;
    const int group_len = nb * bs;

    // Online softmax per row over the group, after the soft cap, the causal/context mask and
    // the window mask (non-empty only in the group holding the window's start).
    bool rescale = false;
    for (int r = 0; r < rows; ++r) {
      float* row_logits = logits + r * logits_stride;
      if (cap > 0.0f) {
        for (int t = 0; t < group_len; t += kLanes) store(row_logits + t, soft_cap(load(row_logits + t), cap));
      }
      const int visible_end = task.first_visible_end + r / task.num_heads;
      const int end = visible_end < task.ctx_end ? visible_end : task.ctx_end;
      const int limit = end - base < group_len ? end - base : group_len;
      for (int t = limit > 0 ? limit : 0; t < group_len; ++t) row_logits[t] = kNegInf;
      const int hidden = window > 0 ? visible_end - window - base : 0;  // tokens before the window
      for (int t = 0; t < hidden && t < group_len; ++t) row_logits[t] = kNegInf;
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
      TQ* dst = static_cast<TQ*>(a.out) + ((task.first_query + q) * a.num_heads + head) * static_cast<int64_t>(hs);
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
  dispatch_kv_dtypes(args, [&](auto cache, auto io) {
    using T = typename decltype(cache)::type;
    using TQ = typename decltype(io)::type;
    fast ? run_fast_task_typed<T, TQ>(args, task, scratch) : run_task_typed<T, TQ>(args, task, scratch);
  });
}


}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE
