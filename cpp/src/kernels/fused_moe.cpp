// fused_moe (fused_moe.h): routing, grouping by expert, the expert matmuls as one
// parallel_for per stage over every expert's tasks (the quantized or dense matmul's own task
// functions, one expert's matrix at a time), SiLU-and-multiply, weighted sum. Baseline flags:
// the per-ISA work is in the matmul tasks it calls.
#include "vpage/kernels/fused_moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "dense_task.h"
#include "float_rows.h"
#include "quant_task.h"
#include "thread_pool.h"
#include "vpage/common.h"
#include "vpage/kernels/dense_matmul.h"
#include "vpage/kernels/half.h"
#include "vpage/kernels/layer_ops.h"

namespace vpage::cpu {
namespace {

constexpr int64_t kTokensPerTask = 16;  // routing, gathering and summing: tokens per task
constexpr int64_t kRowGroup = 4;        // an expert's rows start on a multiple of this (quantized x pairs)

bool known_dtype(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16;
}

void check_weights(const MoeExpertWeights& w, int32_t n, int32_t k, const char* name) {
  VPAGE_CHECK(w.data != nullptr, "fused_moe: null " << name);
  int64_t bytes = 0;
  if (w.quantized) {
    VPAGE_CHECK(quant_type_supported(static_cast<int32_t>(w.qtype)),
                "fused_moe: " << name << " has unsupported quantization type " << static_cast<int32_t>(w.qtype));
    const int32_t block = quant_block_values(w.qtype);
    VPAGE_CHECK(k % block == 0, "fused_moe: " << name << " rows of " << k << " values are not whole blocks of "
                                              << block);
    bytes = static_cast<int64_t>(n) * (k / block) * quant_block_bytes(w.qtype);
  } else {
    VPAGE_CHECK(known_dtype(w.dtype), "fused_moe: " << name << " has unknown dtype code "
                                                    << static_cast<int>(w.dtype));
    bytes = dense_packed_elements(n, k) * dtype_size(w.dtype);
  }
  VPAGE_CHECK(w.expert_bytes >= bytes, "fused_moe: " << name << " experts are " << w.expert_bytes
                                                     << " bytes apart, one needs " << bytes);
}

void check_args(const FusedMoeArgs& a) {
  VPAGE_CHECK(known_dtype(a.dtype), "fused_moe: unknown dtype code " << static_cast<int>(a.dtype));
  VPAGE_CHECK(a.m >= 0 && a.hidden > 0 && a.intermediate > 0 && a.num_experts > 0 && a.top_k >= 1 &&
                  a.top_k <= a.num_experts && a.x_stride >= a.hidden && a.out_stride >= a.hidden,
              "fused_moe: bad sizes (m " << a.m << ", hidden " << a.hidden << ", intermediate " << a.intermediate
                                         << ", experts " << a.num_experts << ", top_k " << a.top_k << ", x_stride "
                                         << a.x_stride << ", out_stride " << a.out_stride << ")");
  check_weights(a.w1, a.intermediate, a.hidden, "w1");
  check_weights(a.w3, a.intermediate, a.hidden, "w3");
  check_weights(a.w2, a.hidden, a.intermediate, "w2");
  if (a.m == 0) return;
  VPAGE_CHECK(a.x != nullptr && a.out != nullptr, "fused_moe: null x or out");
  VPAGE_CHECK(a.router_logits != nullptr || (a.topk_ids != nullptr && a.topk_weights != nullptr),
              "fused_moe: needs router_logits or topk_ids and topk_weights");
  if (a.router_logits == nullptr) {
    for (int64_t i = 0; i < a.m * a.top_k; ++i) {
      VPAGE_CHECK(a.topk_ids[i] >= 0 && a.topk_ids[i] < a.num_experts,
                  "fused_moe: topk_ids[" << i / a.top_k << ", " << i % a.top_k << "] = " << a.topk_ids[i]
                                         << " is not an expert id in [0, " << a.num_experts << ")");
    }
  }
}

// ids / weights [tokens, top_k] of token t of the pass from its router logits: softmax, top_k
// largest (lower id first on ties), optionally renormalised.
void route_token(const FusedMoeArgs& a, const float* logits, int32_t* ids, float* weights, std::vector<float>& p) {
  const int32_t e_count = a.num_experts;
  p.resize(e_count);
  const float max = *std::max_element(logits, logits + e_count);
  float sum = 0.0f;
  for (int32_t e = 0; e < e_count; ++e) {
    p[e] = std::exp(logits[e] - max);
    sum += p[e];
  }
  for (int32_t e = 0; e < e_count; ++e) p[e] /= sum;
  float chosen_sum = 0.0f;
  for (int32_t j = 0; j < a.top_k; ++j) {
    int32_t best = -1;
    for (int32_t e = 0; e < e_count; ++e) {
      if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
    }
    ids[j] = best;
    weights[j] = p[best];
    chosen_sum += p[best];
    p[best] = -1.0f;  // taken
  }
  if (a.renormalize) {
    for (int32_t j = 0; j < a.top_k; ++j) weights[j] /= chosen_sum;
  }
}

// x row (dtype) -> float32.
void widen_row(DType dtype, const void* src, int32_t n, float* dst) {
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, src, sizeof(float) * n);
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src);
  for (int32_t i = 0; i < n; ++i) dst[i] = dtype == DType::kBFloat16 ? bfloat16_to_float(s[i]) : half_to_float(s[i]);
}

// Where a pass's (token, choice) pairs go: expert e's rows are [start[e], start[e] + count[e])
// of the gathered buffers, in token order; row_of[t * top_k + j] is the row of choice j of
// token t. `order` lists the experts that have rows, most rows first.
struct ExpertRows {
  std::vector<int64_t> count, start, row_of;
  std::vector<int32_t> order;
  int64_t total_rows = 0;  // padded

  void build(const int32_t* ids, int64_t tokens, int32_t top_k, int32_t num_experts) {
    count.assign(num_experts, 0);
    for (int64_t i = 0; i < tokens * top_k; ++i) ++count[ids[i]];
    start.assign(num_experts, 0);
    total_rows = 0;
    order.clear();
    for (int32_t e = 0; e < num_experts; ++e) {
      start[e] = total_rows;
      total_rows += (count[e] + kRowGroup - 1) / kRowGroup * kRowGroup;
      if (count[e] > 0) order.push_back(e);
    }
    std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return count[x] > count[y]; });
    std::vector<int64_t> next(start);
    row_of.resize(static_cast<size_t>(tokens * top_k));
    for (int64_t i = 0; i < tokens * top_k; ++i) row_of[i] = next[ids[i]]++;
  }
};

// One stack's matmul: its weights, output rows n, and where its columns go in the output.
struct MatmulPart {
  const MoeExpertWeights* w;
  int32_t n;
  int32_t col0;
};

bool integer_types_differ(const MatmulPart* parts, int count) {
  return count == 2 && parts[0].w->quantized && parts[1].w->quantized && parts[0].w->qtype != parts[1].w->qtype;
}

// out[:, col0 : col0 + n] = x [rows, k] @ W_e^T for every part and every expert's rows (float32;
// out rows out_stride apart): one parallel_for over the tasks of all of them, each expert's cut
// as its own matmul would be. The parts share x's 8-bit rounding, so their block types must
// agree (else they run one after the other).
void expert_matmuls(const MatmulPart* parts, int count, int32_t k, const float* x, float* out, int64_t out_stride,
                    const ExpertRows& rows, int num_threads) {
  if (integer_types_differ(parts, count)) {
    expert_matmuls(parts, 1, k, x, out, out_stride, rows, num_threads);
    expert_matmuls(parts + 1, 1, k, x, out, out_stride, rows, num_threads);
    return;
  }
  struct Matmul {
    int64_t first_task = 0;
    bool quantized = false;
    QuantMatmulTasks quant;
    DenseMatmulArgs dense;
    DensePlan plan;
    const float* x = nullptr;
  };
  const DenseKernels& dense_kernels = selected_dense_kernels();
  QuantizedX qx{};
  const MoeExpertWeights* quantized = nullptr;  // the block type x is rounded for
  for (int part = count - 1; part >= 0; --part) {
    if (parts[part].w->quantized) quantized = parts[part].w;
  }
  if (quantized != nullptr) {
    QuantMatmulArgs all;
    all.m = rows.total_rows;
    all.k = k;
    all.type = quantized->qtype;
    const bool integer = std::any_of(rows.order.begin(), rows.order.end(), [&](int32_t e) {
      QuantMatmulArgs one = all;
      one.m = rows.count[e];
      return quant_integer_path(one);
    });
    if (integer) qx = quant_quantize_x(all, x, k, num_threads);
  }
  std::vector<Matmul> matmuls(rows.order.size() * count);
  int64_t total_tasks = 0;
  for (size_t i = 0; i < rows.order.size(); ++i) {
    for (int part = 0; part < count; ++part) {
      const MoeExpertWeights& w = *parts[part].w;
      const int32_t n = parts[part].n;
      const int32_t e = rows.order[i];
      const int64_t r0 = rows.start[e];
      const void* weight = static_cast<const char*>(w.data) + e * w.expert_bytes;
      float* expert_out = out + r0 * out_stride + parts[part].col0;
      Matmul& mm = matmuls[i * count + part];
      mm.first_task = total_tasks;
      mm.x = x + r0 * k;
      mm.quantized = w.quantized;
      if (w.quantized) {
        QuantMatmulArgs args;
        args.out = expert_out;
        args.weight = static_cast<const uint8_t*>(weight);
        args.m = rows.count[e];
        args.n = n;
        args.k = k;
        args.x_stride = k;
        args.out_stride = out_stride;
        args.type = w.qtype;
        const QuantizedX expert_qx = quant_integer_path(args) ? quant_x_rows(qx, k, r0) : QuantizedX{};
        mm.quant = quant_matmul_tasks(args, mm.x, k, expert_qx, num_threads);
        total_tasks += mm.quant.num_tasks;
      } else {
        DenseMatmulArgs& args = mm.dense;
        args.out = expert_out;
        args.x = mm.x;
        args.weight = weight;
        args.m = rows.count[e];
        args.n = n;
        args.k = k;
        args.x_stride = k;
        args.out_stride = out_stride;
        args.weight_dtype = w.dtype;
        mm.plan = dense_plan(args, num_threads);
        total_tasks += (args.m + mm.plan.m_block - 1) / mm.plan.m_block * mm.plan.panel_groups;
      }
    }
  }
  ThreadPool::instance().parallel_for(total_tasks, num_threads, [&](int64_t task, int) {
    const auto it = std::upper_bound(matmuls.begin(), matmuls.end(), task,
                                     [](int64_t t, const Matmul& mm) { return t < mm.first_task; });
    const Matmul& mm = *(it - 1);
    if (mm.quantized) {
      mm.quant.run(task - mm.first_task);
    } else {
      dense_kernels.run_task(mm.dense, mm.x, k, mm.plan, task - mm.first_task);
    }
  });
}

// One pass over tokens [t0, t0 + tokens).
void run_pass(const FusedMoeArgs& a, int64_t t0, int64_t tokens, int num_threads) {
  thread_local std::vector<int32_t> ids;
  thread_local std::vector<float> weights, xg, gate_up, act, y;
  thread_local ExpertRows rows;
  const int32_t top_k = a.top_k;
  const int64_t pairs = tokens * top_k;
  const int64_t token_tasks = (tokens + kTokensPerTask - 1) / kTokensPerTask;
  ids.resize(pairs);
  weights.resize(pairs);
  int32_t* ids_out = ids.data();
  float* weights_out = weights.data();
  if (a.router_logits != nullptr) {
    ThreadPool::instance().parallel_for(token_tasks, num_threads, [&](int64_t task, int) {
      thread_local std::vector<float> p;
      const int64_t end = std::min(tokens, (task + 1) * kTokensPerTask);
      for (int64_t t = task * kTokensPerTask; t < end; ++t) {
        route_token(a, a.router_logits + (t0 + t) * a.num_experts, ids_out + t * top_k, weights_out + t * top_k, p);
      }
    });
  } else {
    std::copy(a.topk_ids + t0 * top_k, a.topk_ids + (t0 + tokens) * top_k, ids.begin());
    std::copy(a.topk_weights + t0 * top_k, a.topk_weights + (t0 + tokens) * top_k, weights.begin());
  }
  rows.build(ids.data(), tokens, top_k, a.num_experts);
  const int32_t h = a.hidden, inter = a.intermediate;
  xg.assign(static_cast<size_t>(rows.total_rows) * h, 0.0f);  // padding rows stay zero
  gate_up.resize(static_cast<size_t>(rows.total_rows) * 2 * inter);
  act.resize(static_cast<size_t>(rows.total_rows) * inter);
  y.resize(static_cast<size_t>(rows.total_rows) * h);
  const int64_t* row_of = rows.row_of.data();
  float* xg_out = xg.data();
  const char* x = static_cast<const char*>(a.x);
  const int64_t x_row_bytes = a.x_stride * dtype_size(a.dtype);
  ThreadPool::instance().parallel_for(token_tasks, num_threads, [&](int64_t task, int) {
    const int64_t end = std::min(tokens, (task + 1) * kTokensPerTask);
    for (int64_t t = task * kTokensPerTask; t < end; ++t) {
      const void* row = x + (t0 + t) * x_row_bytes;
      for (int32_t j = 0; j < top_k; ++j) widen_row(a.dtype, row, h, xg_out + row_of[t * top_k + j] * h);
    }
  });
  const MatmulPart gate_and_up[2] = {{&a.w1, inter, 0}, {&a.w3, inter, inter}};
  expert_matmuls(gate_and_up, 2, h, xg.data(), gate_up.data(), 2 * inter, rows, num_threads);
  SiluAndMulArgs silu;
  silu.out = act.data();
  silu.x = gate_up.data();
  silu.num_tokens = rows.total_rows;
  silu.d = inter;
  silu_and_mul(silu, num_threads);
  const MatmulPart down[1] = {{&a.w2, h, 0}};
  expert_matmuls(down, 1, inter, act.data(), y.data(), h, rows, num_threads);
  const float* y_rows = y.data();
  char* out = static_cast<char*>(a.out);
  const int64_t out_row_bytes = a.out_stride * dtype_size(a.dtype);
  ThreadPool::instance().parallel_for(token_tasks, num_threads, [&](int64_t task, int) {
    thread_local std::vector<float> sum;
    sum.resize(h);
    const int64_t end = std::min(tokens, (task + 1) * kTokensPerTask);
    for (int64_t t = task * kTokensPerTask; t < end; ++t) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int32_t j = 0; j < top_k; ++j) {
        const float wt = weights_out[t * top_k + j];
        const float* yr = y_rows + row_of[t * top_k + j] * h;
        for (int32_t i = 0; i < h; ++i) sum[i] += wt * yr[i];
      }
      store_float32_row(a.dtype, out + (t0 + t) * out_row_bytes, sum.data(), nullptr, h);
    }
  });
}

}  // namespace

void fused_moe(const FusedMoeArgs& args, int num_threads) {
  check_args(args);
  num_threads = std::max(num_threads, 1);
  for (int64_t t0 = 0; t0 < args.m; t0 += kFusedMoeTokensPerPass) {
    run_pass(args, t0, std::min(kFusedMoeTokensPerPass, args.m - t0), num_threads);
  }
}

}  // namespace vpage::cpu
