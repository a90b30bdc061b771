// vpage::cpu::fused_moe against a double-precision per-expert reference: routing from logits
// (softmax, top-k, renormalised or not) and from given ids, experts without tokens, a token
// routed to every expert, several passes, packed float32 / bfloat16 weights and GGUF blocks
// (float and integer paths), 16-bit activations, strided rows, poisoned outputs; the same
// bits on 1, 2 and 3 threads; bad arguments throw.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "cpu_isas.h"
#include "vpage/common.h"
#include "vpage/kernels/dense_matmul.h"
#include "vpage/kernels/fused_moe.h"
#include "vpage/kernels/half.h"
#include "vpage/kernels/quant_matmul.h"

namespace {

using vpage::DType;
using vpage::QuantType;

// One stack of expert matrices [experts][n, k] in a kernel format, and its float values.
struct Stack {
  std::vector<uint8_t> bytes;
  std::vector<float> values;  // [experts][n][k] as the kernel sees them
  vpage::MoeExpertWeights weights;
};

void put_f16(uint8_t* p, float v) {
  const uint16_t h = vpage::float_to_half(v);
  std::memcpy(p, &h, 2);
}

Stack quantized_stack(QuantType type, int experts, int n, int k, std::mt19937& rng) {
  Stack s;
  const int blocks = k / vpage::quant_block_values(type), size = vpage::quant_block_bytes(type);
  const int64_t expert_bytes = static_cast<int64_t>(n) * blocks * size;
  s.bytes.resize(static_cast<size_t>(experts * expert_bytes));
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(2e-3f, 1e-2f);
  for (auto& b : s.bytes) b = static_cast<uint8_t>(byte(rng));
  for (size_t b = 0; b < s.bytes.size() / size; ++b) {
    uint8_t* block = s.bytes.data() + b * size;
    if (type == QuantType::kQ6_K) {
      put_f16(block + 208, scale(rng));
      continue;
    }
    put_f16(block, scale(rng));
    if (type == QuantType::kQ4_1 || type == QuantType::kQ4_K) put_f16(block + 2, scale(rng));
  }
  s.values.resize(static_cast<size_t>(experts) * n * k);
  vpage::cpu::quant_dequantize_rows(type, s.bytes.data(), static_cast<int64_t>(experts) * n, k, s.values.data());
  s.weights.data = s.bytes.data();
  s.weights.expert_bytes = expert_bytes;
  s.weights.quantized = true;
  s.weights.qtype = type;
  return s;
}

// Expert e's rows [row0, row0 + rows) of a fused stack of n rows per expert (values copied,
// weights pointing into the fused bytes): how a checkpoint's fused gate/up rows serve as w1/w3.
Stack rows_of(const Stack& fused, int experts, int n, int k, int row0, int rows) {
  Stack s;
  for (int e = 0; e < experts; ++e) {
    const float* v = fused.values.data() + (static_cast<size_t>(e) * n + row0) * k;
    s.values.insert(s.values.end(), v, v + static_cast<size_t>(rows) * k);
  }
  s.weights = fused.weights;
  const int64_t row_bytes = fused.weights.expert_bytes / n;
  s.weights.data = static_cast<const uint8_t*>(fused.weights.data) + row0 * row_bytes;
  return s;
}

Stack dense_stack(DType dtype, int experts, int n, int k, std::mt19937& rng) {
  Stack s;
  std::normal_distribution<float> normal(0.0f, 0.2f);
  s.values.resize(static_cast<size_t>(experts) * n * k);
  for (auto& v : s.values) v = normal(rng);
  const int64_t elements = vpage::dense_packed_elements(n, k);
  const int64_t expert_bytes = elements * vpage::dtype_size(dtype);
  s.bytes.resize(static_cast<size_t>(experts * expert_bytes));
  for (int e = 0; e < experts; ++e) {
    const float* w = s.values.data() + static_cast<size_t>(e) * n * k;
    std::vector<uint16_t> narrow;
    const void* src = w;
    if (dtype == DType::kBFloat16) {
      narrow.resize(static_cast<size_t>(n) * k);
      for (size_t i = 0; i < narrow.size(); ++i) {
        narrow[i] = vpage::float_to_bfloat16(w[i]);
        s.values[static_cast<size_t>(e) * n * k + i] = vpage::bfloat16_to_float(narrow[i]);
      }
      src = narrow.data();
    }
    vpage::cpu::dense_pack(dtype, src, n, k, k, s.bytes.data() + e * expert_bytes, 2);
  }
  s.weights.data = s.bytes.data();
  s.weights.expert_bytes = expert_bytes;
  s.weights.dtype = dtype;
  return s;
}

struct Problem {
  int64_t m = 0;
  int hidden = 0, inter = 0, experts = 0, top_k = 0;
  bool renormalize = false;
  bool use_logits = true;
  std::vector<float> x, logits, topk_weights;
  std::vector<int32_t> topk_ids;
};

// Reference routing: softmax in double, top_k largest, optionally renormalised.
void reference_route(const Problem& p, int64_t t, std::vector<int>& ids, std::vector<double>& w) {
  ids.clear();
  w.clear();
  if (!p.use_logits) {
    for (int j = 0; j < p.top_k; ++j) {
      ids.push_back(p.topk_ids[t * p.top_k + j]);
      w.push_back(p.topk_weights[t * p.top_k + j]);
    }
    return;
  }
  const float* l = p.logits.data() + t * p.experts;
  const double mx = *std::max_element(l, l + p.experts);
  std::vector<double> prob(p.experts);
  double sum = 0.0;
  for (int e = 0; e < p.experts; ++e) sum += prob[e] = std::exp(l[e] - mx);
  std::vector<int> order(p.experts);
  for (int e = 0; e < p.experts; ++e) order[e] = e;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return prob[a] > prob[b]; });
  double chosen = 0.0;
  for (int j = 0; j < p.top_k; ++j) {
    ids.push_back(order[j]);
    w.push_back(prob[order[j]] / sum);
    chosen += w.back();
  }
  if (p.renormalize) {
    for (double& v : w) v /= chosen;
  }
}

std::vector<double> reference(const Problem& p, const Stack& w1, const Stack& w3, const Stack& w2) {
  std::vector<double> out(static_cast<size_t>(p.m) * p.hidden, 0.0);
  std::vector<int> ids;
  std::vector<double> w;
  std::vector<double> act(p.inter);
  for (int64_t t = 0; t < p.m; ++t) {
    reference_route(p, t, ids, w);
    const float* x = p.x.data() + t * p.hidden;
    for (int j = 0; j < p.top_k; ++j) {
      const float* g = w1.values.data() + static_cast<size_t>(ids[j]) * p.inter * p.hidden;
      const float* u = w3.values.data() + static_cast<size_t>(ids[j]) * p.inter * p.hidden;
      for (int i = 0; i < p.inter; ++i) {
        double gate = 0.0, up = 0.0;
        for (int c = 0; c < p.hidden; ++c) {
          gate += static_cast<double>(g[static_cast<size_t>(i) * p.hidden + c]) * x[c];
          up += static_cast<double>(u[static_cast<size_t>(i) * p.hidden + c]) * x[c];
        }
        act[i] = gate / (1.0 + std::exp(-gate)) * up;
      }
      const float* d = w2.values.data() + static_cast<size_t>(ids[j]) * p.hidden * p.inter;
      for (int r = 0; r < p.hidden; ++r) {
        double y = 0.0;
        for (int i = 0; i < p.inter; ++i) y += static_cast<double>(d[static_cast<size_t>(r) * p.inter + i]) * act[i];
        out[t * p.hidden + r] += w[j] * y;
      }
    }
  }
  return out;
}

// Logits with a skew: expert 0 never wins (no token when top_k < experts - 1... unless every
// expert is chosen), expert 1 usually does.
Problem make_problem(int64_t m, int hidden, int inter, int experts, int top_k, bool renormalize, std::mt19937& rng,
                     float x_scale = 1.0f) {
  Problem p;
  p.m = m;
  p.hidden = hidden;
  p.inter = inter;
  p.experts = experts;
  p.top_k = top_k;
  p.renormalize = renormalize;
  std::normal_distribution<float> normal;
  p.x.resize(static_cast<size_t>(m) * hidden);
  for (auto& v : p.x) v = x_scale * normal(rng);
  p.logits.resize(static_cast<size_t>(m) * experts);
  for (int64_t t = 0; t < m; ++t) {
    for (int e = 0; e < experts; ++e) {
      p.logits[t * experts + e] = normal(rng) + (e == 0 ? -30.0f : e == 1 ? 2.0f : 0.0f);
    }
  }
  return p;
}

// Runs the kernel on p (x converted to `dtype`, rows strided, poisoned padding) and returns
// out as float32 [m, hidden]; checks that the padding is untouched.
std::vector<float> run(const Problem& p, const Stack& w1, const Stack& w3, const Stack& w2, DType dtype, int threads) {
  const int64_t stride = p.hidden + 3;
  const int size = vpage::dtype_size(dtype);
  std::vector<uint8_t> x(static_cast<size_t>(p.m * stride * size)), out(x.size());
  for (int64_t t = 0; t < p.m; ++t) {
    for (int c = 0; c < p.hidden; ++c) {
      const float v = p.x[t * p.hidden + c];
      uint8_t* dst = x.data() + (t * stride + c) * size;
      if (dtype == DType::kFloat32) {
        std::memcpy(dst, &v, 4);
      } else {
        const uint16_t h = dtype == DType::kBFloat16 ? vpage::float_to_bfloat16(v) : vpage::float_to_half(v);
        std::memcpy(dst, &h, 2);
      }
    }
  }
  std::fill(out.begin(), out.end(), uint8_t{0xff});  // NaN in every dtype
  vpage::FusedMoeArgs a;
  a.out = out.data();
  a.x = x.data();
  if (p.use_logits) {
    a.router_logits = p.logits.data();
  } else {
    a.topk_ids = p.topk_ids.data();
    a.topk_weights = p.topk_weights.data();
  }
  a.m = p.m;
  a.hidden = p.hidden;
  a.intermediate = p.inter;
  a.num_experts = p.experts;
  a.top_k = p.top_k;
  a.renormalize = p.renormalize;
  a.x_stride = stride;
  a.out_stride = stride;
  a.dtype = dtype;
  a.w1 = w1.weights;
  a.w3 = w3.weights;
  a.w2 = w2.weights;
  vpage::cpu::fused_moe(a, threads);
  std::vector<float> result(static_cast<size_t>(p.m) * p.hidden);
  for (int64_t t = 0; t < p.m; ++t) {
    for (int c = 0; c < stride; ++c) {
      const uint8_t* src = out.data() + (t * stride + c) * size;
      if (c >= p.hidden) {
        EXPECT(std::all_of(src, src + size, [](uint8_t b) { return b == 0xff; }));
        continue;
      }
      float v;
      if (dtype == DType::kFloat32) {
        std::memcpy(&v, src, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, src, 2);
        v = dtype == DType::kBFloat16 ? vpage::bfloat16_to_float(h) : vpage::half_to_float(h);
      }
      result[t * p.hidden + c] = v;
    }
  }
  return result;
}

// Runs on 1, 2 and 3 threads (the same bits), compares with the reference within tol x the
// largest reference value.
void check(const Problem& p, const Stack& w1, const Stack& w3, const Stack& w2, DType dtype, double tol) {
  const std::vector<float> got = run(p, w1, w3, w2, dtype, 2);
  for (int threads : {1, 3}) {
    const std::vector<float> again = run(p, w1, w3, w2, dtype, threads);
    EXPECT(std::memcmp(again.data(), got.data(), sizeof(float) * got.size()) == 0);
  }
  const std::vector<double> ref = reference(p, w1, w3, w2);
  double scale = 0.0, worst = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    scale = std::max(scale, std::fabs(ref[i]));
    worst = std::max(worst, std::isfinite(got[i]) ? std::fabs(ref[i] - got[i]) : 1e30);
  }
  EXPECT_MSG(scale > 0.0 && worst <= tol * scale,
             "worst " + std::to_string(worst) + " scale " + std::to_string(scale) + " m " + std::to_string(p.m));
}

void check_float_weights(std::mt19937& rng) {
  const Stack w1 = dense_stack(DType::kFloat32, 6, 40, 72, rng);
  const Stack w3 = dense_stack(DType::kFloat32, 6, 40, 72, rng);
  const Stack w2 = dense_stack(DType::kFloat32, 6, 72, 40, rng);
  for (int64_t m : {1, 3, 17, 70}) {
    for (bool renormalize : {false, true}) {
      check(make_problem(m, 72, 40, 6, 2, renormalize, rng), w1, w3, w2, DType::kFloat32, 1e-5);
    }
  }
  // Every token to every expert (top_k = experts; expert 0 included).
  check(make_problem(9, 72, 40, 6, 6, false, rng), w1, w3, w2, DType::kFloat32, 1e-5);
  // 16-bit activations: x and out rounded, float32 inside.
  check(make_problem(13, 72, 40, 6, 3, true, rng), w1, w3, w2, DType::kBFloat16, 2e-2);
  check(make_problem(13, 72, 40, 6, 3, true, rng), w1, w3, w2, DType::kFloat16, 2e-3);
}

TEST_CASE("fused_moe: packed float weights, routed from logits, every ISA") {
  const vpage_test::AutoIsaOnExit restore_isa;
  std::mt19937 rng(3);
  for (const std::string& isa : vpage_test::supported_isas()) {
    vpage::cpu::set_cpu_isa(isa);
    check_float_weights(rng);
  }
}

TEST_CASE("fused_moe: bfloat16 weights, given ids, more tokens than one pass") {
  std::mt19937 rng(5);
  const Stack w1 = dense_stack(DType::kBFloat16, 4, 32, 48, rng);
  const Stack w3 = dense_stack(DType::kBFloat16, 4, 32, 48, rng);
  const Stack w2 = dense_stack(DType::kBFloat16, 4, 48, 32, rng);
  Problem p = make_problem(vpage::cpu::kFusedMoeTokensPerPass + 37, 48, 32, 4, 2, false, rng);
  p.use_logits = false;
  std::uniform_real_distribution<float> weight(0.1f, 1.0f);
  for (int64_t t = 0; t < p.m; ++t) {  // expert 3 gets no token; the pair order varies
    p.topk_ids.push_back(t % 3);
    p.topk_ids.push_back((t + 1 + t % 2) % 3);
    p.topk_weights.push_back(weight(rng));
    p.topk_weights.push_back(weight(rng));
  }
  check(p, w1, w3, w2, DType::kFloat32, 1e-5);
}

void check_quantized_weights(std::mt19937& rng) {
  // K formats: Q4_K on the integer paths (x rounded to 8 bits; with the GEMM off, the float
  // paths from 17 rows per expert, k-major from 128); Q6_K always on the float paths.
  {
    const Stack w13 = quantized_stack(QuantType::kQ4_K, 4, 2 * 256, 256, rng);  // fused gate/up rows
    const Stack w1 = rows_of(w13, 4, 512, 256, 0, 256), w3 = rows_of(w13, 4, 512, 256, 256, 256);
    const Stack w2 = quantized_stack(QuantType::kQ6_K, 4, 256, 256, rng);
    for (int64_t m : {1, 5, 150}) {
      check(make_problem(m, 256, 256, 4, 2, true, rng, 0.1f), w1, w3, w2, DType::kFloat32, 3e-2);
    }
    vpage::cpu::set_quant_integer_gemm_rows(0);
    check(make_problem(150, 256, 256, 4, 2, true, rng, 0.1f), w1, w3, w2, DType::kFloat32, 1e-4);
    vpage::cpu::set_quant_integer_gemm_rows(vpage::cpu::kQuantIntegerGemmMaxRows);
  }
  // 32-value formats: x and the activations rounded to 8 bits per 32 values for the integer
  // paths (dot up to 16 rows per expert, GEMM beyond); with the GEMM off, the float path.
  const Stack w1 = quantized_stack(QuantType::kQ4_1, 5, 96, 64, rng);
  const Stack w3 = quantized_stack(QuantType::kQ8_0, 5, 96, 64, rng);  // another type: gate and up apart
  const Stack w2 = quantized_stack(QuantType::kQ4_0, 5, 64, 96, rng);
  for (int64_t m : {1, 6, 40}) check(make_problem(m, 64, 96, 5, 3, false, rng), w1, w3, w2, DType::kFloat32, 3e-2);
  vpage::cpu::set_quant_integer_gemm_rows(0);
  check(make_problem(40, 64, 96, 5, 3, false, rng), w1, w3, w2, DType::kFloat32, 3e-2);
  vpage::cpu::set_quant_integer_gemm_rows(vpage::cpu::kQuantIntegerGemmMaxRows);
}

TEST_CASE("fused_moe: GGUF block weights on the float and integer paths, every ISA") {
  const vpage_test::AutoIsaOnExit restore_isa;
  std::mt19937 rng(11);
  for (const std::string& isa : vpage_test::supported_isas()) {
    vpage::cpu::set_cpu_isa(isa);
    check_quantized_weights(rng);
  }
}

TEST_CASE("fused_moe: bad arguments throw") {
  std::mt19937 rng(1);
  const Stack w1 = dense_stack(DType::kFloat32, 2, 32, 32, rng);
  const Stack w2 = dense_stack(DType::kFloat32, 2, 32, 32, rng);
  std::vector<float> x(32), out(32), weights = {1.0f};
  std::vector<int32_t> ids = {2};
  vpage::FusedMoeArgs a;
  a.out = out.data();
  a.x = x.data();
  a.topk_ids = ids.data();
  a.topk_weights = weights.data();
  a.m = 1;
  a.hidden = 32;
  a.intermediate = 32;
  a.num_experts = 2;
  a.top_k = 1;
  a.x_stride = 32;
  a.out_stride = 32;
  a.w1 = w1.weights;
  a.w3 = w1.weights;
  a.w2 = w2.weights;
  EXPECT_THROWS_WITH(vpage::cpu::fused_moe(a, 1), vpage::CheckError, "not an expert id");
  ids[0] = 1;
  vpage::cpu::fused_moe(a, 1);
  a.top_k = 3;
  EXPECT_THROWS_WITH(vpage::cpu::fused_moe(a, 1), vpage::CheckError, "bad sizes");
  a.top_k = 1;
  a.w2.expert_bytes -= 4;
  EXPECT_THROWS_WITH(vpage::cpu::fused_moe(a, 1), vpage::CheckError, "bytes apart");
  a.w2 = w2.weights;
  a.w3.quantized = true;
  a.w3.qtype = QuantType::kQ4_K;  // 32 values per row: not whole blocks of 256
  EXPECT_THROWS_WITH(vpage::cpu::fused_moe(a, 1), vpage::CheckError, "whole blocks");
}

}  // namespace

TEST_MAIN()
