// The CPU paged prefill attention task kernel (several queries per sequence, causal),
// compiled once per instruction set like attention_impl.h, which it builds on (helpers,
// Scratch sizing, simd_vec.h); attention_<isa>.cpp includes both.
#pragma once

#include "attention_impl.h"

namespace vpage::cpu::VPAGE_ISA_NAMESPACE {

// Prefill task kernel ("rows in lanes"): the R = queries x heads rows of a task are the
// SIMD lanes (RV = ceil(R / kLanes) vectors), so QK, softmax and PV are all vertical:
//   QK: s[t][rows] = sum_d K(t, d) * qT[d][rows]   (K(t, d) broadcast, qT loaded)
//   PV: oT[d][rows] += sum_t V(d, t) * p[t][rows]  (V(d, t) broadcast, p loaded)
// Both are register-blocked outer products reading each K/V element once per task, with
// no horizontal sums; the online softmax max/sum are per-lane vectors. 16-bit blocks are
// first converted to fp32 (so broadcasts come straight from memory). The soft cap, when set,
// is a pass over each block's scores. Causal masking is applied only to tokens at or past the
// first query's visible end (the diagonal), window masking only to tokens before the last
// query's window start (the task starts at the first query's window block).
// Scratch: qT [hs][RV*kLanes], oT [hs][RV*kLanes], s [bs][RV*kLanes], kf/vf [hs*bs],
// visible end per lane, m, l, window start per lane, rowbuf [RV*kLanes][hs].
constexpr int kMaxPrefillRowVecs = 4;

inline int64_t prefill_scratch_floats(int32_t rows, int32_t head_size, int32_t block_size) {
  const int64_t rl = round_up(rows, kLanes);
  return 3 * head_size * rl + static_cast<int64_t>(block_size) * rl +
         2 * round_up(static_cast<int64_t>(head_size) * block_size, kLanes) + 4 * rl + kLanes;
}

// QK for TT tokens [t0, t0 + TT) of a block: s[t][rv] = sum_d K(t, d) qT[d][rv].
// K(t, d) = kb[(d / x) * bs * x + t * x + d % x] (fp32 block, cache layout).
template <int RV, int TT>
inline void pf_qk(const float* kb, const float* qT, float* s, int t0, int hs, int bs, int x) {
  Vec acc[TT][RV];
  for (int t = 0; t < TT; ++t)
    for (int v = 0; v < RV; ++v) acc[t][v] = zero();
  for (int dc = 0; dc < hs; dc += x) {
    const float* kchunk = kb + static_cast<int64_t>(dc / x) * bs * x + static_cast<int64_t>(t0) * x;
    for (int j = 0; j < x; ++j) {
      const float* q = qT + static_cast<int64_t>(dc + j) * RV * kLanes;
      Vec qv[RV];
      for (int v = 0; v < RV; ++v) qv[v] = load(q + v * kLanes);
      for (int t = 0; t < TT; ++t) {
        const Vec k = set1(kchunk[t * x + j]);
        for (int v = 0; v < RV; ++v) acc[t][v] = fma(k, qv[v], acc[t][v]);
      }
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int v = 0; v < RV; ++v) store(s + static_cast<int64_t>(t0 + t) * RV * kLanes + v * kLanes, acc[t][v]);
}

// PV for DD dims [d0, d0 + DD) over tokens [0, n): oT[d][rv] = oT[d][rv] * alpha + sum_t V(d, t) p[t][rv].
// V(d, t) = vb[d * bs + t].
template <int RV, int DD>
inline void pf_pv(const float* vb, const float* p, float* oT, const Vec* alpha, int d0, int n, int bs) {
  Vec acc[DD][RV];
  for (int d = 0; d < DD; ++d)
    for (int v = 0; v < RV; ++v) acc[d][v] = mul(load(oT + static_cast<int64_t>(d0 + d) * RV * kLanes + v * kLanes), alpha[v]);
  for (int t = 0; t < n; ++t) {
    Vec pv[RV];
    for (int v = 0; v < RV; ++v) pv[v] = load(p + static_cast<int64_t>(t) * RV * kLanes + v * kLanes);
    for (int d = 0; d < DD; ++d) {
      const Vec vv = set1(vb[static_cast<int64_t>(d0 + d) * bs + t]);
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
inline void pf_qk_block(const float* kb, const float* qT, float* s, int n, int hs, int bs, int x) {
  constexpr int TT = pf_tokens_per_pass<RV>();
  int t0 = 0;
  for (; t0 + TT <= n; t0 += TT) pf_qk<RV, TT>(kb, qT, s, t0, hs, bs, x);
  for (; t0 + 4 <= n; t0 += 4) pf_qk<RV, 4>(kb, qT, s, t0, hs, bs, x);
  for (; t0 < n; ++t0) pf_qk<RV, 1>(kb, qT, s, t0, hs, bs, x);
}

template <int RV, typename T, typename TQ>
void run_prefill_typed(const PagedAttentionArgs& a, const AttentionTask& task, float* scratch) {
  constexpr int x = 16 / static_cast<int>(sizeof(T));
  constexpr int RL = RV * kLanes;
  const int hs = a.cache.head_size;
  const int bs = a.cache.block_size;
  const int64_t block_elems = static_cast<int64_t>(hs) * bs;
  const int rows = task.num_queries * task.num_heads;
  float* qT = scratch;
  float* oT = qT + static_cast<int64_t>(hs) * RL;
  float* s = oT + static_cast<int64_t>(hs) * RL;
  float* kf = s + static_cast<int64_t>(bs) * RL;
  float* vf = kf + round_up(block_elems, kLanes);
  float* vis = vf + round_up(block_elems, kLanes);
  float* m = vis + RL;
  float* l = m + RL;
  float* visb = l + RL;       // first visible position per lane (window start)
  float* rowbuf = visb + RL;  // [RL][hs]: rows in row-major order (query in, output out)

  // qT[d][r] = q_r[d] * scale; padding lanes zero and see the whole task context.
  const TQ* query = static_cast<const TQ*>(a.query);
  for (int64_t i = 0; i < static_cast<int64_t>(hs) * RL; i += kLanes) store(qT + i, zero());
  // (Converted rows first, padding rows zero, then a transpose by strided loads.)
  for (int r = 0; r < rows; ++r) {
    const int q = r / task.num_heads;
    const int head = task.first_head + r % task.num_heads;
    const TQ* src = query + (task.first_query + q) * a.query_stride + static_cast<int64_t>(head) * hs;
    for (int d = 0; d < hs; d += kLanes) store(rowbuf + static_cast<int64_t>(r) * hs + d, mul(load(src + d), set1(a.scale)));
  }
  for (int64_t i = static_cast<int64_t>(rows) * hs; i < static_cast<int64_t>(RL) * hs; i += kLanes) store(rowbuf + i, zero());
  for (int d = 0; d < hs; ++d) {
    for (int v = 0; v < RV; ++v) {
      store(qT + static_cast<int64_t>(d) * RL + v * kLanes, load_strided(rowbuf + static_cast<int64_t>(v) * kLanes * hs + d, hs));
    }
  }
  const int window = a.sliding_window;
  const float cap = a.logits_soft_cap;
  for (int r = 0; r < RL; ++r) {
    const int end = r < rows ? task.first_visible_end + r / task.num_heads : task.ctx_end;
    vis[r] = static_cast<float>(end < task.ctx_end ? end : task.ctx_end);
    visb[r] = static_cast<float>(r < rows && window > 0 ? end - window : task.ctx_begin);
  }
  // Window start of the task's last query: blocks starting before it need the window mask.
  const int last_window_begin = window > 0 ? task.first_visible_end + task.num_queries - 1 - window : 0;
  // m starts at the lowest finite float, not -inf: with a window, a lane may see no token of
  // the first blocks, and exp(-inf - m) must stay 0 (never exp(-inf + inf)).
  for (int i = 0; i < RL; i += kLanes) {
    store(m + i, set1(-3.402823466e38f));
    store(l + i, zero());
  }
  for (int64_t i = 0; i < static_cast<int64_t>(hs) * RL; i += kLanes) store(oT + i, zero());

  const T* key_cache = static_cast<const T*>(a.key_cache);
  const T* value_cache = static_cast<const T*>(a.value_cache);
  const int32_t* table = a.block_tables + static_cast<int64_t>(task.seq) * a.max_blocks_per_seq;
  const int64_t head_offset = static_cast<int64_t>(task.kv_head) * block_elems;
  const int64_t block_stride = static_cast<int64_t>(a.cache.num_kv_heads) * block_elems;
  const int first_block = task.ctx_begin / bs;
  const int end_block = (task.ctx_end + bs - 1) / bs;
  constexpr int DD = pf_dims_per_pass<RV>();
  for (int b = first_block; b < end_block; ++b) {
    const int base = b * bs;
    const int n = task.ctx_end - base < bs ? task.ctx_end - base : bs;
    const T* kbt = key_cache + table[b] * block_stride + head_offset;
    const T* vbt = value_cache + table[b] * block_stride + head_offset;
    const float* kb;
    const float* vb;
    if constexpr (sizeof(T) == sizeof(float)) {
      kb = reinterpret_cast<const float*>(kbt);
      vb = reinterpret_cast<const float*>(vbt);
    } else {
      for (int64_t i = 0; i < block_elems; i += kLanes) {
        store(kf + i, load(kbt + i));
        store(vf + i, load(vbt + i));
      }
      kb = kf;
      vb = vf;
    }
    pf_qk_block<RV>(kb, qT, s, n, hs, bs, x);
    if (cap > 0.0f) {
      for (int64_t i = 0; i < static_cast<int64_t>(n) * RL; i += kLanes) store(s + i, soft_cap(load(s + i), cap));
    }
    // Causal mask on the diagonal (token base + t is hidden from lanes with vis <= it) and
    // window mask before the window starts (hidden from lanes with visb > it).
    if (base + n > task.first_visible_end || base < last_window_begin) {
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
      alpha[v] = b == first_block ? zero() : exp_nonpositive(add(mold, mul(mx, set1(-1.0f))));
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
    for (int d0 = 0; d0 < hs; d0 += DD) pf_pv<RV, DD>(vb, s, oT, alpha, d0, n, bs);
  }
  // out row r = oT[:, r] / l[r], gathered column by column.
  for (int r = 0; r < rows; ++r) {
    const int q = r / task.num_heads;
    const int head = task.first_head + r % task.num_heads;
    TQ* dst = static_cast<TQ*>(a.out) + ((task.first_query + q) * a.num_heads + head) * static_cast<int64_t>(hs);
    const Vec inv = set1(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
    for (int d = 0; d < hs; d += kLanes) store(dst + d, mul(load_strided(oT + static_cast<int64_t>(d) * RL + r, RL), inv));
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
