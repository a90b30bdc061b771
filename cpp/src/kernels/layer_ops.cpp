// Fused RMSNorm (+ residual add, or per head), SiLU- and GELU(tanh)-and-multiply, a
// sigmoid-gated add. Threads take
// ranges of tokens. The float32 row loops are compiled for AVX-512, AVX2 and baseline (chosen
// at load time) and, like rotary.cpp, without FMA contraction, so each product and sum is
// rounded as torch's unfused operations round it. 16-bit rows go through float32 row buffers,
// rounded to the dtype wherever torch's unfused operations would store a 16-bit tensor.
#include "vpage/kernels/layer_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "exp_approx.h"
#include "target_clones.h"
#include "thread_pool.h"
#include "vpage/common.h"
#include "vpage/kernels/half.h"

namespace vpage::cpu {
namespace {

constexpr int64_t kTokensPerTask = 8;
constexpr int kLanes = 16;  // partial sums of sum_of_squares: one AVX-512 vector

VPAGE_TARGET_CLONES
float sum_of_squares(const float* x, int32_t n) {
  float acc[kLanes] = {};
  int32_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l] * x[i + l];
  }
  float total = 0.0f;
  for (; i < n; ++i) total += x[i] * x[i];
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  return total;
}

VPAGE_TARGET_CLONES
void add_into(float* residual, const float* x, int32_t n) {
  for (int32_t i = 0; i < n; ++i) residual[i] += x[i];
}

VPAGE_TARGET_CLONES
void normalize_f32(float* out, const float* src, float inv, const float* weight, int32_t n) {
  for (int32_t i = 0; i < n; ++i) out[i] = (src[i] * inv) * weight[i];
}

// Two passes: in one loop GCC evaluates the division once per clamp case of exp_clamped and
// blends the results, and the divisions were most of SiLU's time (3% of a batch-64 decode step).
VPAGE_TARGET_CLONES
void silu_f32(float* out, const float* a, int32_t n) {
  for (int32_t i = 0; i < n; ++i) out[i] = 1.0f + exp_clamped(-a[i]);
  for (int32_t i = 0; i < n; ++i) out[i] = a[i] / out[i];
}

// gelu_tanh(a) = 0.5 a (1 + tanh(y)), y = sqrt(2/pi) (a + 0.044715 a^3), by the identity
// 1 + tanh(y) = 2 / (1 + exp(-2 y)): a / (1 + exp(a (kGeluLinear + kGeluCubic a^2))). Unlike
// `1 + tanh`, this never cancels. Two passes, as silu_f32.
constexpr float kGeluLinear = static_cast<float>(-2.0 * 0.79788456080286535588);  // -2 sqrt(2/pi)
constexpr float kGeluCubic = static_cast<float>(-2.0 * 0.79788456080286535588 * 0.044715);

VPAGE_TARGET_CLONES
void gelu_tanh_f32(float* out, const float* a, int32_t n) {
  for (int32_t i = 0; i < n; ++i) out[i] = 1.0f + exp_clamped(a[i] * (kGeluLinear + kGeluCubic * (a[i] * a[i])));
  for (int32_t i = 0; i < n; ++i) out[i] = a[i] / out[i];
}

VPAGE_TARGET_CLONES
void mul_into(float* out, const float* b, int32_t n) {
  for (int32_t i = 0; i < n; ++i) out[i] *= b[i];
}

// A 16-bit dtype's conversions.
struct Half {
  static float load(uint16_t v) { return half_to_float(v); }
  static uint16_t store(float v) { return float_to_half(v); }
};
struct BFloat16 {
  static float load(uint16_t v) { return bfloat16_to_float(v); }
  static uint16_t store(float v) { return float_to_bfloat16(v); }
};

template <class Codec>
void load_row(float* dst, const uint16_t* src, int32_t n) {
  for (int32_t i = 0; i < n; ++i) dst[i] = Codec::load(src[i]);
}

// Rounds a float row to the dtype and back, storing the 16-bit values in `stored` if given.
template <class Codec>
void round_row(float* row, uint16_t* stored, int32_t n) {
  for (int32_t i = 0; i < n; ++i) {
    const uint16_t v = Codec::store(row[i]);
    if (stored != nullptr) stored[i] = v;
    row[i] = Codec::load(v);
  }
}

// bfloat16 rows: branch-free loops the vectoriser turns into shifts and integer rounding
// (the generic loops above stay scalar, called through Codec).
VPAGE_TARGET_CLONES
void load_bf16_row(float* dst, const uint16_t* src, int32_t n) {
  for (int32_t i = 0; i < n; ++i) dst[i] = bfloat16_to_float(src[i]);
}

VPAGE_TARGET_CLONES
void round_bf16_row(float* row, uint16_t* stored, int32_t n) {
  if (stored == nullptr) {
    for (int32_t i = 0; i < n; ++i) row[i] = bfloat16_to_float(float_to_bfloat16(row[i]));
    return;
  }
  for (int32_t i = 0; i < n; ++i) {
    const uint16_t v = float_to_bfloat16(row[i]);
    stored[i] = v;
    row[i] = bfloat16_to_float(v);
  }
}

template <>
void load_row<BFloat16>(float* dst, const uint16_t* src, int32_t n) {
  load_bf16_row(dst, src, n);
}

template <>
void round_row<BFloat16>(float* row, uint16_t* stored, int32_t n) {
  round_bf16_row(row, stored, n);
}

// Fused bfloat16 row passes: each element goes through the same operations and roundings as
// in the one-operation-per-pass loops of the 16-bit path, in fewer passes over the row (those
// passes' conversions were ~4% of the bfloat16 throughput trace on Zen 4).

// src = float(bf16(x + residual)), the rounded sum also stored into residual (fused add).
VPAGE_TARGET_CLONES
void add_round_bf16_row(float* src, const uint16_t* x, uint16_t* residual, int32_t n) {
  for (int32_t i = 0; i < n; ++i) {
    const uint16_t sum = float_to_bfloat16(bfloat16_to_float(x[i]) + bfloat16_to_float(residual[i]));
    residual[i] = sum;
    src[i] = bfloat16_to_float(sum);
  }
}

// out = bf16(float(bf16(src * inv)) * weight): RMSNorm's scaling, then its weight.
VPAGE_TARGET_CLONES
void scale_round_bf16_row(uint16_t* out, const float* src, float inv, const uint16_t* weight, int32_t n) {
  for (int32_t i = 0; i < n; ++i) {
    const float scaled = bfloat16_to_float(float_to_bfloat16(src[i] * inv));
    out[i] = float_to_bfloat16(scaled * bfloat16_to_float(weight[i]));
  }
}

std::vector<float>& row_buffer(int which, size_t floats) {
  thread_local std::vector<float> buffers[3];
  if (buffers[which].size() < floats) buffers[which].resize(floats);
  return buffers[which];
}

// out = (src * inv) * weight, inv = 1 / sqrt(mean(src^2) + eps); `out` may be `src`.
void normalize_row_f32(float* out, const float* src, const float* weight, int32_t n, float eps) {
  const float inv = 1.0f / std::sqrt(sum_of_squares(src, n) / static_cast<float>(n) + eps);
  normalize_f32(out, src, inv, weight, n);
}

// The 16-bit twin: src (the row in float32) is overwritten, weight holds the 16-bit weight's
// values in float32; dtype(src * inv) times the weight is rounded into `out`.
template <class Codec>
void normalize_row_16(uint16_t* out, float* src, const float* weight, int32_t n, float eps) {
  const float inv = 1.0f / std::sqrt(sum_of_squares(src, n) / static_cast<float>(n) + eps);
  for (int32_t i = 0; i < n; ++i) src[i] *= inv;
  round_row<Codec>(src, nullptr, n);
  mul_into(src, weight, n);
  round_row<Codec>(src, out, n);
}

void rms_norm_f32(const RmsNormArgs& a, int64_t t) {
  const int32_t n = a.hidden_size;
  const float* x = static_cast<const float*>(a.x) + t * n;
  const float* src = x;
  if (a.residual != nullptr) {
    float* residual = static_cast<float*>(a.residual) + t * n;
    add_into(residual, x, n);
    src = residual;
  }
  normalize_row_f32(static_cast<float*>(a.out) + t * n, src, static_cast<const float*>(a.weight), n, a.eps);
}

template <class Codec>
void rms_norm_16(const RmsNormArgs& a, int64_t t) {
  const int32_t n = a.hidden_size;
  float* src = row_buffer(0, n).data();
  float* other = row_buffer(1, n).data();
  load_row<Codec>(src, static_cast<const uint16_t*>(a.x) + t * n, n);
  if (a.residual != nullptr) {
    uint16_t* residual = static_cast<uint16_t*>(a.residual) + t * n;
    load_row<Codec>(other, residual, n);
    add_into(src, other, n);
    round_row<Codec>(src, residual, n);
  }
  load_row<Codec>(other, static_cast<const uint16_t*>(a.weight), n);
  normalize_row_16<Codec>(static_cast<uint16_t*>(a.out) + t * n, src, other, n, a.eps);
}

template <>
void rms_norm_16<BFloat16>(const RmsNormArgs& a, int64_t t) {
  const int32_t n = a.hidden_size;
  float* src = row_buffer(0, n).data();
  const uint16_t* x = static_cast<const uint16_t*>(a.x) + t * n;
  if (a.residual != nullptr) {
    add_round_bf16_row(src, x, static_cast<uint16_t*>(a.residual) + t * n, n);
  } else {
    load_bf16_row(src, x, n);
  }
  const float inv = 1.0f / std::sqrt(sum_of_squares(src, n) / static_cast<float>(n) + a.eps);
  scale_round_bf16_row(static_cast<uint16_t*>(a.out) + t * n, src, inv, static_cast<const uint16_t*>(a.weight), n);
}

void rms_norm_heads_f32(const RmsNormHeadsArgs& a, int64_t t) {
  float* row = static_cast<float*>(a.x) + t * a.row_stride;
  for (int32_t h = 0; h < a.num_heads; ++h) {
    float* head = row + static_cast<int64_t>(h) * a.head_size;
    normalize_row_f32(head, head, static_cast<const float*>(a.weight), a.head_size, a.eps);
  }
}

template <class Codec>
void rms_norm_heads_16(const RmsNormHeadsArgs& a, int64_t t) {
  const int32_t n = a.head_size;
  float* src = row_buffer(0, n).data();
  float* weight = row_buffer(1, n).data();
  load_row<Codec>(weight, static_cast<const uint16_t*>(a.weight), n);
  uint16_t* row = static_cast<uint16_t*>(a.x) + t * a.row_stride;
  for (int32_t h = 0; h < a.num_heads; ++h) {
    uint16_t* head = row + static_cast<int64_t>(h) * n;
    load_row<Codec>(src, head, n);
    normalize_row_16<Codec>(head, src, weight, n, a.eps);
  }
}

// Columns [c0, c0 + n) of token t's row of a gated activation (elementwise, so any split of
// a row gives the same values).
struct Slice {
  int64_t t;
  int32_t c0, n;
};

template <typename T>
const T* gate_of(const SiluAndMulArgs& a, Slice s) {
  return static_cast<const T*>(a.x) + s.t * 2 * a.d + s.c0;
}
template <typename T>
T* out_of(const SiluAndMulArgs& a, Slice s) {
  return static_cast<T*>(a.out) + s.t * a.d + s.c0;
}

// A gated activation's float32 slice (Act: out = act(gate), then out *= up).
template <void (*Act)(float*, const float*, int32_t)>
void gated_f32(const SiluAndMulArgs& a, Slice s) {
  const float* gate = gate_of<float>(a, s);
  float* out = out_of<float>(a, s);
  Act(out, gate, s.n);
  mul_into(out, gate + a.d, s.n);
}

// Its float16 slice, rounded to float16 where torch stores: act(gate), then the product.
template <void (*Act)(float*, const float*, int32_t)>
void gated_f16(const SiluAndMulArgs& a, Slice s) {
  const uint16_t* gate = gate_of<uint16_t>(a, s);
  float* in = row_buffer(0, s.n).data();
  float* out = row_buffer(1, s.n).data();
  load_row<Half>(in, gate, s.n);
  Act(out, in, s.n);
  round_row<Half>(out, nullptr, s.n);
  load_row<Half>(in, gate + a.d, s.n);
  mul_into(out, in, s.n);
  round_row<Half>(out, out_of<uint16_t>(a, s), s.n);
}

// The gated activations' bfloat16 rows in two passes: `denominator` (the activation's first
// pass, of float(gate)), then out = bf16(float(bf16(float(gate) / denominator)) * float(up)).
VPAGE_TARGET_CLONES
void silu_denominator_bf16(float* out, const uint16_t* gate, int32_t n) {
  for (int32_t i = 0; i < n; ++i) out[i] = 1.0f + exp_clamped(-bfloat16_to_float(gate[i]));
}

VPAGE_TARGET_CLONES
void gelu_tanh_denominator_bf16(float* out, const uint16_t* gate, int32_t n) {
  for (int32_t i = 0; i < n; ++i) {
    const float a = bfloat16_to_float(gate[i]);
    out[i] = 1.0f + exp_clamped(a * (kGeluLinear + kGeluCubic * (a * a)));
  }
}

VPAGE_TARGET_CLONES
void gated_product_bf16(uint16_t* out, const uint16_t* gate, const float* denominator, const uint16_t* up,
                        int32_t n) {
  for (int32_t i = 0; i < n; ++i) {
    const float activated = bfloat16_to_float(float_to_bfloat16(bfloat16_to_float(gate[i]) / denominator[i]));
    out[i] = float_to_bfloat16(activated * bfloat16_to_float(up[i]));
  }
}

template <void (*Denominator)(float*, const uint16_t*, int32_t)>
void gated_bf16(const SiluAndMulArgs& a, Slice s) {
  const uint16_t* gate = gate_of<uint16_t>(a, s);
  float* denominator = row_buffer(0, s.n).data();
  Denominator(denominator, gate, s.n);
  gated_product_bf16(out_of<uint16_t>(a, s), gate, denominator, gate + a.d, s.n);
}

float sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }

VPAGE_TARGET_CLONES
void add_scaled(float* out, float s, const float* y, int32_t n) {
  for (int32_t i = 0; i < n; ++i) out[i] = out[i] + s * y[i];
}

void sigmoid_gated_add_f32(const SigmoidGatedAddArgs& a, int64_t t) {
  add_scaled(static_cast<float*>(a.out) + t * a.d, sigmoid(static_cast<const float*>(a.gate)[t]),
             static_cast<const float*>(a.y) + t * a.d, a.d);
}

template <class Codec>
void sigmoid_gated_add_16(const SigmoidGatedAddArgs& a, int64_t t) {
  uint16_t* out = static_cast<uint16_t*>(a.out) + t * a.d;
  float* sum = row_buffer(0, a.d).data();
  float* y = row_buffer(1, a.d).data();
  load_row<Codec>(sum, out, a.d);
  load_row<Codec>(y, static_cast<const uint16_t*>(a.y) + t * a.d, a.d);
  add_scaled(sum, sigmoid(Codec::load(static_cast<const uint16_t*>(a.gate)[t])), y, a.d);
  round_row<Codec>(sum, out, a.d);
}

template <class Args>
void for_token_ranges(const Args& a, int num_threads, void (*f32)(const Args&, int64_t),
                      void (*f16)(const Args&, int64_t), void (*bf16)(const Args&, int64_t)) {
  void (*row)(const Args&, int64_t) = a.dtype == DType::kFloat32 ? f32 : a.dtype == DType::kFloat16 ? f16 : bf16;
  const int64_t num_tasks = (a.num_tokens + kTokensPerTask - 1) / kTokensPerTask;
  ThreadPool::instance().parallel_for(num_tasks, std::max(num_threads, 1), [&](int64_t task, int) {
    const int64_t end = std::min(a.num_tokens, (task + 1) * kTokensPerTask);
    for (int64_t t = task * kTokensPerTask; t < end; ++t) row(a, t);
  });
}

// Gated activations: tasks of kTokensPerTask whole rows, or, when those are fewer than the
// threads (a decode step of a few streams), one task per token, and when even those are
// fewer, per column slice of at least kMinSliceColumns of a token's row.
constexpr int32_t kMinSliceColumns = 2048;

void for_gated_slices(const SiluAndMulArgs& a, int num_threads, void (*f32)(const SiluAndMulArgs&, Slice),
                      void (*f16)(const SiluAndMulArgs&, Slice), void (*bf16)(const SiluAndMulArgs&, Slice)) {
  void (*part)(const SiluAndMulArgs&, Slice) =
      a.dtype == DType::kFloat32 ? f32 : a.dtype == DType::kFloat16 ? f16 : bf16;
  const int threads = std::max(num_threads, 1);
  const int64_t row_tasks = (a.num_tokens + kTokensPerTask - 1) / kTokensPerTask;
  if (row_tasks >= threads || a.num_tokens == 0) {
    ThreadPool::instance().parallel_for(row_tasks, threads, [&](int64_t task, int) {
      const int64_t end = std::min(a.num_tokens, (task + 1) * kTokensPerTask);
      for (int64_t t = task * kTokensPerTask; t < end; ++t) part(a, Slice{t, 0, a.d});
    });
    return;
  }
  // One task per token and slice; slice boundaries on multiples of 16 columns (whole
  // vectors, 64-byte float32 lines).
  const int64_t slices = std::min<int64_t>((threads + a.num_tokens - 1) / a.num_tokens,
                                           std::max<int32_t>(a.d / kMinSliceColumns, 1));
  const auto boundary = [&](int64_t k) { return static_cast<int32_t>(a.d * k / slices / 16 * 16); };
  ThreadPool::instance().parallel_for(a.num_tokens * slices, threads, [&](int64_t task, int) {
    const int64_t k = task % slices;
    const int32_t c0 = boundary(k), c1 = k + 1 == slices ? a.d : boundary(k + 1);
    part(a, Slice{task / slices, c0, c1 - c0});
  });
}

void check_dtype(DType dtype, const char* op) {
  VPAGE_CHECK(dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16,
              op << ": unknown dtype code " << static_cast<int>(dtype));
}

}  // namespace

void rms_norm(const RmsNormArgs& args, int num_threads) {
  check_dtype(args.dtype, "rms_norm");
  VPAGE_CHECK(args.num_tokens >= 0 && args.hidden_size > 0 && args.eps >= 0.0f,
              "rms_norm: bad sizes (num_tokens " << args.num_tokens << ", hidden_size " << args.hidden_size
                                                 << ") or eps");
  for_token_ranges(args, num_threads, &rms_norm_f32, &rms_norm_16<Half>, &rms_norm_16<BFloat16>);
}

void silu_and_mul(const SiluAndMulArgs& args, int num_threads) {
  check_dtype(args.dtype, "silu_and_mul");
  VPAGE_CHECK(args.num_tokens >= 0 && args.d > 0,
              "silu_and_mul: bad sizes (num_tokens " << args.num_tokens << ", d " << args.d << ")");
  for_gated_slices(args, num_threads, &gated_f32<silu_f32>, &gated_f16<silu_f32>,
                   &gated_bf16<silu_denominator_bf16>);
}

void gelu_tanh_and_mul(const GeluTanhAndMulArgs& args, int num_threads) {
  check_dtype(args.dtype, "gelu_tanh_and_mul");
  VPAGE_CHECK(args.num_tokens >= 0 && args.d > 0,
              "gelu_tanh_and_mul: bad sizes (num_tokens " << args.num_tokens << ", d " << args.d << ")");
  for_gated_slices(args, num_threads, &gated_f32<gelu_tanh_f32>, &gated_f16<gelu_tanh_f32>,
                   &gated_bf16<gelu_tanh_denominator_bf16>);
}

void sigmoid_gated_add(const SigmoidGatedAddArgs& args, int num_threads) {
  check_dtype(args.dtype, "sigmoid_gated_add");
  VPAGE_CHECK(args.num_tokens >= 0 && args.d > 0,
              "sigmoid_gated_add: bad sizes (num_tokens " << args.num_tokens << ", d " << args.d << ")");
  for_token_ranges(args, num_threads, &sigmoid_gated_add_f32, &sigmoid_gated_add_16<Half>,
                   &sigmoid_gated_add_16<BFloat16>);
}

void rms_norm_heads(const RmsNormHeadsArgs& args, int num_threads) {
  check_dtype(args.dtype, "rms_norm_heads");
  VPAGE_CHECK(args.num_tokens >= 0 && args.num_heads >= 0 && args.head_size > 0 && args.eps >= 0.0f &&
                  (args.num_tokens <= 1 || args.row_stride >= static_cast<int64_t>(args.num_heads) * args.head_size),
              "rms_norm_heads: bad sizes (num_tokens " << args.num_tokens << ", num_heads " << args.num_heads
                                                       << ", head_size " << args.head_size << ", row_stride "
                                                       << args.row_stride << ") or eps");
  for_token_ranges(args, num_threads, &rms_norm_heads_f32, &rms_norm_heads_16<Half>, &rms_norm_heads_16<BFloat16>);
}

}  // namespace vpage::cpu
