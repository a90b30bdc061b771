// The CPU attention task kernel of many queries per sequence: paged prefill (causal) and
// packed attention (bidirectional, K/V in token-major rows: encoders), compiled once per
// instruction set like attention_impl.h, which it builds on (helpers, simd_vec.h);
// attention_<isa>.cpp includes both.
#pragma once

#include "attention_impl.h"

namespace vpage::cpu::VPAGE_ISA_NAMESPACE {

// The task kernel ("rows in lanes"): the R = queries x heads rows of a task are the
// SIMD lanes (RV = ceil(R / kLanes) vectors), so QK, softmax and PV are all vertical:
//   QK: s[t][rows] = sum_d K(t, d) * qT[d][rows]   (K(t, d) broadcast, qT loaded)
//   PV: oT[d][rows] += sum_t V(d, t) * p[t][rows]  (V(d, t) broadcast, p loaded)
// Both are register-blocked outer products reading each K/V element once per task, with
// no horizontal sums; the online softmax max/sum are per-lane vectors. 16-bit tiles are
// first converted to fp32 (so broadcasts come straight from memory). The soft cap, when set,
// is a pass over each tile's scores. Masks are applied only to the tiles that cross a row's
// visible bounds (the causal diagonal, window edges).

// A tile of n context tokens in fp32, in either layout: K(t, d) = k[(d / kx) * k_chunk +
// t * k_token + d % kx] and V(d, t) = v[d * v_dim + t * v_token]. A paged cache block is
// kx = x, k_chunk = bs * x, k_token = x, v_dim = bs, v_token = 1; token-major rows are
// kx = head_size, k_token = v_token = the row stride, v_dim = 1.
struct KvTile {
  const float* k;
  const float* v;
  int n;
  int kx, k_chunk, k_token;
  int v_dim, v_token;
  const BF16* kh = nullptr;  // bf16 dot-product QK: the keys as stored (same addressing), k unused
};

// QK for TT tokens [t0, t0 + TT) of a tile: s[t][rv] = sum_d K(t, d) qT[d][rv].
template <int RV, int TT>
inline void pf_qk(const KvTile& kv, const float* qT, float* s, int t0, int hs) {
  Vec acc[TT][RV];
  for (int t = 0; t < TT; ++t)
    for (int v = 0; v < RV; ++v) acc[t][v] = zero();
  for (int dc = 0; dc < hs; dc += kv.kx) {
    const float* kchunk = kv.k + static_cast<int64_t>(dc / kv.kx) * kv.k_chunk + static_cast<int64_t>(t0) * kv.k_token;
    for (int j = 0; j < kv.kx; ++j) {
      const float* q = qT + static_cast<int64_t>(dc + j) * RV * kLanes;
      Vec qv[RV];
      for (int v = 0; v < RV; ++v) qv[v] = load(q + v * kLanes);
      for (int t = 0; t < TT; ++t) {
        const Vec k = set1(kchunk[static_cast<int64_t>(t) * kv.k_token + j]);
        for (int v = 0; v < RV; ++v) acc[t][v] = fma(k, qv[v], acc[t][v]);
      }
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int v = 0; v < RV; ++v) store(s + static_cast<int64_t>(t0 + t) * RV * kLanes + v * kLanes, acc[t][v]);
}

// PV for DD dims [d0, d0 + DD) over the tile's tokens: oT[d][rv] = oT[d][rv] * alpha + sum_t V(d, t) p[t][rv].
template <int RV, int DD>
inline void pf_pv(const KvTile& kv, const float* p, float* oT, const Vec* alpha, int d0) {
  Vec acc[DD][RV];
  for (int d = 0; d < DD; ++d)
    for (int v = 0; v < RV; ++v) acc[d][v] = mul(load(oT + static_cast<int64_t>(d0 + d) * RV * kLanes + v * kLanes), alpha[v]);
  for (int t = 0; t < kv.n; ++t) {
    Vec pv[RV];
    for (int v = 0; v < RV; ++v) pv[v] = load(p + static_cast<int64_t>(t) * RV * kLanes + v * kLanes);
    const float* vt = kv.v + static_cast<int64_t>(t) * kv.v_token;
    for (int d = 0; d < DD; ++d) {
      const Vec vv = set1(vt[static_cast<int64_t>(d0 + d) * kv.v_dim]);
      for (int v = 0; v < RV; ++v) acc[d][v] = fma(vv, pv[v], acc[d][v]);
    }
  }
  for (int d = 0; d < DD; ++d)
    for (int v = 0; v < RV; ++v) store(oT + static_cast<int64_t>(d0 + d) * RV * kLanes + v * kLanes, acc[d][v]);
}

// Tokens (QK) / dims (PV) per register-blocked pass: accumulators = passes x RV, kept
// within the register file (32 vector registers with AVX-512, 16 otherwise).
template <int RV>
constexpr int pf_tokens_per_pass() {
  return kLanes == 16 ? (RV == 1 ? 16 : RV <= 3 ? 8 : 4) : (RV == 1 ? 8 : RV == 2 ? 4 : 2);
}
template <int RV>
constexpr int pf_dims_per_pass() { return pf_tokens_per_pass<RV>(); }

template <int RV>
inline void pf_qk_tile(const KvTile& kv, const float* qT, float* s, int hs) {
  constexpr int TT = pf_tokens_per_pass<RV>();
  int t0 = 0;
  for (; t0 + TT <= kv.n; t0 += TT) pf_qk<RV, TT>(kv, qT, s, t0, hs);
  for (; t0 + 4 <= kv.n; t0 += 4) pf_qk<RV, 4>(kv, qT, s, t0, hs);
  for (; t0 < kv.n; ++t0) pf_qk<RV, 1>(kv, qT, s, t0, hs);
}

#if defined(__AVX512BF16__)
// QK by bf16 dot products (the avx512bf16 build, bfloat16 queries and keys): qP[j][r] holds row
// r's query values of dims 2j and 2j + 1 as one bf16 pair, the key's pair of the same dims is
// broadcast, and vdpbf16ps adds both exact products to lane r. Half the instructions of pf_qk,
// and the keys are read as stored (no float32 copy). Scores come out unscaled.
template <int RV, int TT>
inline void pf_qk_dot(const KvTile& kv, const uint32_t* qP, float* s, int t0, int hs) {
  __m512 acc[TT][RV];
  for (int t = 0; t < TT; ++t)
    for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int dc = 0; dc < hs; dc += kv.kx) {
    const BF16* kchunk = kv.kh + static_cast<int64_t>(dc / kv.kx) * kv.k_chunk + static_cast<int64_t>(t0) * kv.k_token;
    for (int j = 0; j < kv.kx; j += 2) {
      const uint32_t* q = qP + static_cast<int64_t>((dc + j) / 2) * RV * kLanes;
      __m512bh qv[RV];
      for (int v = 0; v < RV; ++v) qv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + v * kLanes));
      for (int t = 0; t < TT; ++t) {
        uint32_t pair;
        __builtin_memcpy(&pair, kchunk + static_cast<int64_t>(t) * kv.k_token + j, sizeof(pair));
        const __m512bh k = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
        for (int v = 0; v < RV; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], qv[v], k);
      }
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int v = 0; v < RV; ++v) _mm512_storeu_ps(s + static_cast<int64_t>(t0 + t) * RV * kLanes + v * kLanes, acc[t][v]);
}

template <int RV>
inline void pf_qk_dot_tile(const KvTile& kv, const uint32_t* qP, float* s, int hs) {
  constexpr int TT = pf_tokens_per_pass<RV>();
  int t0 = 0;
  for (; t0 + TT <= kv.n; t0 += TT) pf_qk_dot<RV, TT>(kv, qP, s, t0, hs);
  for (; t0 + 4 <= kv.n; t0 += 4) pf_qk_dot<RV, 4>(kv, qP, s, t0, hs);
  for (; t0 < kv.n; ++t0) pf_qk_dot<RV, 1>(kv, qP, s, t0, hs);
}
#endif

template <typename A, typename B>
struct SameType {
  static constexpr bool value = false;
};
template <typename A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

// Whether QK takes bf16 dot products: bfloat16 queries over bfloat16 keys, in the avx512bf16 build.
template <typename T, typename TQ>
constexpr bool dot_qk() {
#if defined(__AVX512BF16__)
  return SameType<T, BF16>::value && SameType<TQ, BF16>::value;
#else
  return false;
#endif
}

// One task of the rows-in-lanes kernel, whatever holds its K/V. Row r is query r / heads,
// head r % heads: its query row at q + (r / heads) * q_stride + (r % heads) * head_size, its
// output row likewise in out. Lane r sees context positions [begin_r, end_r) (the caller's
// bounds(r, begin, end)); the tiles [tile * k, tile * (k + 1)) of [ctx_begin, ctx_end) are read,
// ctx_begin a tile start. Tiles reaching past mask_end (the least end of the task's rows) or
// starting before mask_begin (the greatest begin) are masked per lane; the others need no mask.
template <typename TQ>
struct LaneTask {
  const TQ* q;
  int64_t q_stride;
  TQ* out;
  int64_t out_stride;
  int rows, heads;
  float scale, cap;
  int ctx_begin, ctx_end, tile;
  int mask_end, mask_begin;
};

// Scratch: qT [hs][RV*kLanes], oT [hs][RV*kLanes], s [tile][RV*kLanes], kf/vf [hs*tile] (16-bit
// tiles converted to fp32), visible end per lane, m, l, visible begin per lane, rowbuf [RV*kLanes][hs].
inline int64_t prefill_scratch_floats(int32_t rows, int32_t head_size, int32_t tile) {
  const int64_t rl = round_up(rows, kLanes);
  return 3 * head_size * rl + static_cast<int64_t>(tile) * rl +
         2 * round_up(static_cast<int64_t>(head_size) * tile, kLanes) + 4 * rl + kLanes;
}

// fetch(k, base, n, kf, vf) returns tile k (tokens [base, base + n)) as a KvTile, converting
// into kf/vf (hs * tile floats each) when its elements are not fp32. With kDotQK (bfloat16
// queries and keys, the avx512bf16 build) the tile's keys stay bf16 (KvTile::kh) and QK takes
// bf16 dot products (qT's room then holds the query pairs, unscaled; the scores are scaled after).
template <int RV, bool kDotQK, typename TQ, typename Bounds, typename Fetch>
void rows_in_lanes(const LaneTask<TQ>& task, int hs, Bounds&& bounds, Fetch&& fetch, float* scratch) {
  constexpr int RL = RV * kLanes;
  const int tile = task.tile;
  const int64_t tile_elems = static_cast<int64_t>(hs) * tile;
  const int rows = task.rows;
  float* qT = scratch;
  float* oT = qT + static_cast<int64_t>(hs) * RL;
  float* s = oT + static_cast<int64_t>(hs) * RL;
  float* kf = s + static_cast<int64_t>(tile) * RL;
  float* vf = kf + round_up(tile_elems, kLanes);
  float* vis = vf + round_up(tile_elems, kLanes);
  float* m = vis + RL;
  float* l = m + RL;
  float* visb = l + RL;       // first visible position per lane
  float* rowbuf = visb + RL;  // [RL][hs]: rows in row-major order (query in, output out)

  // The query rows as QK reads them; padding lanes zero (they see the whole task context).
  const TQ* q0 = task.q;
  auto query_row = [&](int r) { return q0 + (r / task.heads) * task.q_stride + static_cast<int64_t>(r % task.heads) * hs; };
  if constexpr (kDotQK) {
    // qP[j][r] = (q_r[2j], q_r[2j + 1]) as stored, in qT's room.
    uint32_t* qP = reinterpret_cast<uint32_t*>(qT);
    for (int64_t i = 0; i < static_cast<int64_t>(hs / 2) * RL; ++i) qP[i] = 0;
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < hs / 2; ++j) __builtin_memcpy(qP + static_cast<int64_t>(j) * RL + r, query_row(r) + 2 * j, 4);
    }
  } else {
    // qT[d][r] = q_r[d] * scale: converted rows first, padding rows zero, then a transpose by
    // strided loads.
    for (int r = 0; r < rows; ++r) {
      for (int d = 0; d < hs; d += kLanes) {
        store(rowbuf + static_cast<int64_t>(r) * hs + d, mul(load(query_row(r) + d), set1(task.scale)));
      }
    }
    for (int64_t i = static_cast<int64_t>(rows) * hs; i < static_cast<int64_t>(RL) * hs; i += kLanes) store(rowbuf + i, zero());
    for (int d = 0; d < hs; ++d) {
      for (int v = 0; v < RV; ++v) {
        store(qT + static_cast<int64_t>(d) * RL + v * kLanes, load_strided(rowbuf + static_cast<int64_t>(v) * kLanes * hs + d, hs));
      }
    }
  }
  for (int r = 0; r < RL; ++r) {
    int begin = task.ctx_begin, end = task.ctx_end;
    if (r < rows) bounds(r, begin, end);
    visb[r] = static_cast<float>(begin);
    vis[r] = static_cast<float>(end);
  }
  // m starts at the lowest finite float, not -inf: a lane may see no token of the first
  // tiles, and exp(-inf - m) must stay 0 (never exp(-inf + inf)).
  for (int i = 0; i < RL; i += kLanes) {
    store(m + i, set1(-3.402823466e38f));
    store(l + i, zero());
  }
  for (int64_t i = 0; i < static_cast<int64_t>(hs) * RL; i += kLanes) store(oT + i, zero());

  const int first_tile = task.ctx_begin / tile;
  const int end_tile = (task.ctx_end + tile - 1) / tile;
  constexpr int DD = pf_dims_per_pass<RV>();
  for (int b = first_tile; b < end_tile; ++b) {
    const int base = b * tile;
    const int n = task.ctx_end - base < tile ? task.ctx_end - base : tile;
    const KvTile kv = fetch(b, base, n, kf, vf);
#if defined(__AVX512BF16__)
    if constexpr (kDotQK) {
      pf_qk_dot_tile<RV>(kv, reinterpret_cast<const uint32_t*>(qT), s, hs);
      for (int64_t i = 0; i < static_cast<int64_t>(n) * RL; i += kLanes) store(s + i, mul(load(s + i), set1(task.scale)));
    } else {
      pf_qk_tile<RV>(kv, qT, s, hs);
    }
#else
    pf_qk_tile<RV>(kv, qT, s, hs);
#endif
    if (task.cap > 0.0f) {
      for (int64_t i = 0; i < static_cast<int64_t>(n) * RL; i += kLanes) store(s + i, soft_cap(load(s + i), task.cap));
    }
    // Token base + t is hidden from lanes with vis <= it or visb > it.
    if (base + n > task.mask_end || base < task.mask_begin) {
      for (int t = 0; t < n; ++t) {
        const float pos = static_cast<float>(base + t);
        float* st = s + static_cast<int64_t>(t) * RL;
        for (int r = 0; r < RL; ++r) {
          if (pos >= vis[r] || pos < visb[r]) st[r] = kNegInf;
        }
      }
    }
    // Online softmax per lane (m >= the lowest finite float, so no -inf - -inf occurs).
    Vec alpha[RV];
    for (int v = 0; v < RV; ++v) {
      Vec mx = load(m + v * kLanes);
      for (int t = 0; t < n; ++t) mx = max(mx, load(s + static_cast<int64_t>(t) * RL + v * kLanes));
      const Vec mold = load(m + v * kLanes);
      alpha[v] = b == first_tile ? zero() : exp_nonpositive(add(mold, mul(mx, set1(-1.0f))));
      const Vec neg = mul(mx, set1(-1.0f));
      Vec sum = zero();
      for (int t = 0; t < n; ++t) {
        float* st = s + static_cast<int64_t>(t) * RL + v * kLanes;
        const Vec p = exp_nonpositive(add(load(st), neg));
        store(st, p);
        sum = add(sum, p);
      }
      store(l + v * kLanes, fma(load(l + v * kLanes), alpha[v], sum));
      store(m + v * kLanes, mx);
    }
    for (int d0 = 0; d0 < hs; d0 += DD) pf_pv<RV, DD>(kv, s, oT, alpha, d0);
  }
  // out row r = oT[:, r] / l[r], gathered column by column.
  for (int r = 0; r < rows; ++r) {
    TQ* dst = task.out + (r / task.heads) * task.out_stride + static_cast<int64_t>(r % task.heads) * hs;
    const Vec inv = set1(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
    for (int d = 0; d < hs; d += kLanes) store(dst + d, mul(load_strided(oT + static_cast<int64_t>(d) * RL + r, RL), inv));
  }
}

// Paged prefill (causal): query q of the task sees [0, first_visible_end + q), with a window W
// only its last W positions; the task starts at the first query's window block.
template <int RV, typename T, typename TQ>
void run_prefill_typed(const PagedAttentionArgs& a, const AttentionTask& task, float* scratch) {
  constexpr int x = 16 / static_cast<int>(sizeof(T));
  const int hs = a.cache.head_size;
  const int bs = a.cache.block_size;
  const int64_t block_elems = static_cast<int64_t>(hs) * bs;
  const int window = a.sliding_window;
  const int64_t hs64 = hs;
  LaneTask<TQ> lt;
  lt.q = static_cast<const TQ*>(a.query) + task.first_query * a.query_stride + task.first_head * hs64;
  lt.q_stride = a.query_stride;
  lt.out = static_cast<TQ*>(a.out) + (task.first_query * a.num_heads + task.first_head) * hs64;
  lt.out_stride = a.num_heads * hs64;
  lt.rows = task.num_queries * task.num_heads;
  lt.heads = task.num_heads;
  lt.scale = a.scale;
  lt.cap = a.logits_soft_cap;
  lt.ctx_begin = task.ctx_begin;
  lt.ctx_end = task.ctx_end;
  lt.tile = bs;
  lt.mask_end = task.first_visible_end;
  // Window start of the task's last query: blocks starting before it need the window mask.
  lt.mask_begin = window > 0 ? task.first_visible_end + task.num_queries - 1 - window : 0;
  const int ctx_end = task.ctx_end;
  auto bounds = [&](int r, int& begin, int& end) {
    end = task.first_visible_end + r / task.num_heads;
    if (end > ctx_end) end = ctx_end;
    if (window > 0) begin = end - window;
  };
  const T* key_cache = static_cast<const T*>(a.key_cache);
  const T* value_cache = static_cast<const T*>(a.value_cache);
  const int32_t* table = a.block_tables + static_cast<int64_t>(task.seq) * a.max_blocks_per_seq;
  const int64_t head_offset = static_cast<int64_t>(task.kv_head) * block_elems;
  const int64_t block_stride = static_cast<int64_t>(a.cache.num_kv_heads) * block_elems;
  constexpr bool kDot = dot_qk<T, TQ>();
  auto fetch = [&](int b, int, int n, float* kf, float* vf) {
    const T* kbt = key_cache + table[b] * block_stride + head_offset;
    const T* vbt = value_cache + table[b] * block_stride + head_offset;
    if constexpr (sizeof(T) == sizeof(float)) {
      return KvTile{reinterpret_cast<const float*>(kbt), reinterpret_cast<const float*>(vbt), n, x, bs * x, x, bs, 1};
    } else if constexpr (kDot) {
      for (int64_t i = 0; i < block_elems; i += kLanes) store(vf + i, load(vbt + i));
      return KvTile{nullptr, vf, n, x, bs * x, x, bs, 1, reinterpret_cast<const BF16*>(kbt)};
    } else {
      for (int64_t i = 0; i < block_elems; i += kLanes) {
        store(kf + i, load(kbt + i));
        store(vf + i, load(vbt + i));
      }
      return KvTile{kf, vf, n, x, bs * x, x, bs, 1};
    }
  };
  rows_in_lanes<RV, kDot>(lt, hs, bounds, fetch, scratch);
}

// Packed attention (bidirectional): query q of the task, at position p of its sequence, sees
// every key, or with a window W those in [p - W, p + W]; K/V tiles of kPackedTile tokens read
// from token-major rows (16-bit ones converted into kf/vf).
template <int RV, typename T>
void run_packed_typed(const PackedAttentionArgs& a, const PackedTask& task, float* scratch) {
  const int hs = a.head_size;
  const int len = a.kv_lens[task.seq];
  const int w = a.window;
  const int first_pos = a.q_offsets[task.seq] + task.first_query;
  const int last_pos = first_pos + task.num_queries - 1;
  const int64_t head = static_cast<int64_t>(task.head) * hs;
  const int64_t q_row = a.q_starts[task.seq] + task.first_query;
  auto lo = [&](int pos) { return w > 0 && pos - w > 0 ? pos - w : 0; };
  auto hi = [&](int pos) { return w > 0 && pos + w + 1 < len ? pos + w + 1 : len; };
  LaneTask<T> lt;
  lt.q = static_cast<const T*>(a.query) + q_row * a.query_stride + head;
  lt.q_stride = a.query_stride;
  lt.out = static_cast<T*>(a.out) + q_row * a.out_stride + head;
  lt.out_stride = a.out_stride;
  lt.rows = task.num_queries;
  lt.heads = 1;
  lt.scale = a.scale;
  lt.cap = 0.0f;
  lt.tile = kPackedTile;
  lt.ctx_begin = lo(first_pos) / kPackedTile * kPackedTile;
  lt.ctx_end = hi(last_pos);
  lt.mask_end = hi(first_pos);
  lt.mask_begin = lo(last_pos);
  auto bounds = [&](int r, int& begin, int& end) {
    begin = lo(first_pos + r);
    end = hi(first_pos + r);
  };
  const int64_t kv_row = a.kv_starts[task.seq];
  const T* key = static_cast<const T*>(a.key) + kv_row * a.key_stride + head;
  const T* value = static_cast<const T*>(a.value) + kv_row * a.value_stride + head;
  const int ks = static_cast<int>(a.key_stride), vs = static_cast<int>(a.value_stride);
  constexpr bool kDot = dot_qk<T, T>();
  auto fetch = [&](int, int base, int n, float* kf, float* vf) {
    if constexpr (sizeof(T) == sizeof(float)) {
      return KvTile{reinterpret_cast<const float*>(key + static_cast<int64_t>(base) * ks),
                    reinterpret_cast<const float*>(value + static_cast<int64_t>(base) * vs), n, hs, 0, ks, 1, vs};
    } else {
      for (int t = 0; t < n; ++t) {
        const T* kt = key + static_cast<int64_t>(base + t) * ks;
        const T* vt = value + static_cast<int64_t>(base + t) * vs;
        for (int d = 0; d < hs; d += kLanes) {
          if constexpr (!kDot) store(kf + static_cast<int64_t>(t) * hs + d, load(kt + d));
          store(vf + static_cast<int64_t>(t) * hs + d, load(vt + d));
        }
      }
      if constexpr (kDot) {
        return KvTile{nullptr, vf, n, hs, 0, ks, 1, hs, reinterpret_cast<const BF16*>(key + static_cast<int64_t>(base) * ks)};
      } else {
        return KvTile{kf, vf, n, hs, 0, hs, 1, hs};
      }
    }
  };
  rows_in_lanes<RV, kDot>(lt, hs, bounds, fetch, scratch);
}

template <typename T>
void run_packed_rv(const PackedAttentionArgs& a, const PackedTask& task, float* scratch) {
  switch ((task.num_queries + kLanes - 1) / kLanes) {
    case 1: run_packed_typed<1, T>(a, task, scratch); break;
    case 2: run_packed_typed<2, T>(a, task, scratch); break;
    case 3: run_packed_typed<3, T>(a, task, scratch); break;
    default: run_packed_typed<4, T>(a, task, scratch); break;
  }
}

inline void run_packed_task(const PackedAttentionArgs& args, const PackedTask& task, float* scratch) {
  switch (args.dtype) {
    case DType::kFloat32: run_packed_rv<float>(args, task, scratch); break;
    case DType::kFloat16: run_packed_rv<F16>(args, task, scratch); break;
    case DType::kBFloat16: run_packed_rv<BF16>(args, task, scratch); break;
  }
}

template <typename T, typename TQ>
void run_prefill_rv(const PagedAttentionArgs& a, const AttentionTask& task, float* scratch) {
  const int rows = task.num_queries * task.num_heads;
  switch ((rows + kLanes - 1) / kLanes) {
    case 1: run_prefill_typed<1, T, TQ>(a, task, scratch); break;
    case 2: run_prefill_typed<2, T, TQ>(a, task, scratch); break;
    case 3: run_prefill_typed<3, T, TQ>(a, task, scratch); break;
    default: run_prefill_typed<4, T, TQ>(a, task, scratch); break;
  }
}

inline void run_prefill_task(const PagedAttentionArgs& args, const AttentionTask& task, float* scratch) {
  dispatch_kv_dtypes(args, [&](auto cache, auto io) {
    run_prefill_rv<typename decltype(cache)::type, typename decltype(io)::type>(args, task, scratch);
  });
}

}  // namespace vpage::cpu::VPAGE_ISA_NAMESPACE
