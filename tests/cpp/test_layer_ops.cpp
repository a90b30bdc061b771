// The layer ops the Gemma, Qwen3 and Phi-4-mini families add, against double: GELU(tanh)-and-
// multiply, per-head RMSNorm on strided rows, partial rotary. Odd sizes (vector remainders),
// 2 threads, NaN-poisoned outputs and columns that must stay untouched; bad sizes throw. And
// the bfloat16 rows of RMSNorm and the gated activations against their float32 formulas with
// torch's roundings, bit for bit, and the gated activations' column slices against whole rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "kernels/exp_approx.h"
#include "vpage/common.h"
#include "vpage/kernels/half.h"
#include "vpage/kernels/layer_ops.h"
#include "vpage/kernels/rotary.h"

using namespace vpage_test;

namespace {

std::vector<float> random_values(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<uint16_t> random_bf16(size_t n, float scale, uint32_t seed) {
  std::vector<uint16_t> v(n);
  const std::vector<float> values = random_values(n, scale, seed);
  for (size_t i = 0; i < n; ++i) v[i] = vpage::float_to_bfloat16(values[i]);
  return v;
}

float bf(uint16_t v) { return vpage::bfloat16_to_float(v); }
float rounded(float v) { return bf(vpage::float_to_bfloat16(v)); }

// sum of x^2 in the kernel's order: 16 partial sums over whole vectors, the tail, then the partials.
float sum_of_squares(const std::vector<float>& x) {
  float acc[16] = {};
  size_t i = 0;
  for (; i + 16 <= x.size(); i += 16) {
    for (size_t l = 0; l < 16; ++l) acc[l] += x[i + l] * x[i + l];
  }
  float total = 0.0f;
  for (; i < x.size(); ++i) total += x[i] * x[i];
  for (float a : acc) total += a;
  return total;
}

}  // namespace

TEST_CASE("bfloat16 rms_norm (+ residual): the float32 formula rounded where torch stores, bit for bit") {
  const int64_t tokens = 9;
  for (const int32_t hidden : {1, 17, 576, 4099}) {
    for (const bool with_residual : {false, true}) {
      const std::vector<uint16_t> x = random_bf16(tokens * hidden, 3.0f, hidden);
      const std::vector<uint16_t> weight = random_bf16(hidden, 2.0f, hidden + 1);
      const std::vector<uint16_t> residual_before = random_bf16(tokens * hidden, 3.0f, hidden + 2);
      std::vector<uint16_t> residual = residual_before, out(tokens * hidden, 0x7fc1);
      vpage::RmsNormArgs a;
      a.out = out.data();
      a.x = x.data();
      a.residual = with_residual ? residual.data() : nullptr;
      a.weight = weight.data();
      a.num_tokens = tokens;
      a.hidden_size = hidden;
      a.eps = 1e-5f;
      a.dtype = vpage::DType::kBFloat16;
      vpage::cpu::rms_norm(a, 2);
      bool exact = true;
      for (int64_t t = 0; t < tokens; ++t) {
        std::vector<float> src(hidden);
        for (int32_t i = 0; i < hidden; ++i) {
          const size_t j = t * hidden + i;
          src[i] = with_residual ? rounded(bf(x[j]) + bf(residual_before[j])) : bf(x[j]);
          if (with_residual) exact = exact && residual[j] == vpage::float_to_bfloat16(src[i]);
        }
        const float inv = 1.0f / std::sqrt(sum_of_squares(src) / static_cast<float>(hidden) + a.eps);
        for (int32_t i = 0; i < hidden; ++i) {
          exact = exact && out[t * hidden + i] == vpage::float_to_bfloat16(rounded(src[i] * inv) * bf(weight[i]));
        }
      }
      EXPECT_MSG(exact, "bfloat16 rms_norm, hidden " + std::to_string(hidden) +
                            (with_residual ? " with residual" : ""));
    }
  }
}

TEST_CASE("bfloat16 silu_and_mul and gelu_tanh_and_mul: the float32 formulas rounded once between, bit for bit") {
  const int64_t tokens = 7;
  constexpr float kLinear = static_cast<float>(-2.0 * 0.79788456080286535588);
  constexpr float kCubic = static_cast<float>(-2.0 * 0.79788456080286535588 * 0.044715);
  for (const int32_t d : {1, 33, 1536, 4099}) {
    const std::vector<uint16_t> gate_up = random_bf16(tokens * 2 * d, 6.0f, d);
    for (const bool gelu : {false, true}) {
      std::vector<uint16_t> out(tokens * d, 0x7fc1);
      vpage::SiluAndMulArgs a;
      a.out = out.data();
      a.x = gate_up.data();
      a.num_tokens = tokens;
      a.d = d;
      a.dtype = vpage::DType::kBFloat16;
      gelu ? vpage::cpu::gelu_tanh_and_mul(a, 2) : vpage::cpu::silu_and_mul(a, 2);
      bool exact = true;
      for (int64_t t = 0; t < tokens; ++t) {
        for (int32_t i = 0; i < d; ++i) {
          const float g = bf(gate_up[t * 2 * d + i]), u = bf(gate_up[t * 2 * d + d + i]);
          const float e = gelu ? 1.0f + vpage::cpu::exp_clamped(g * (kLinear + kCubic * (g * g)))
                               : 1.0f + vpage::cpu::exp_clamped(-g);
          exact = exact && out[t * d + i] == vpage::float_to_bfloat16(rounded(g / e) * u);
        }
      }
      EXPECT_MSG(exact, std::string(gelu ? "gelu_tanh" : "silu") + "_and_mul bfloat16, d " + std::to_string(d));
    }
  }
}

TEST_CASE("gated activations of a few tokens, split into column slices: whole rows' bits") {
  // One thread computes whole rows; with 2 or 4 threads a few tokens' wide rows are split into
  // column slices (elementwise, so the bits must not change), many tokens into token tasks.
  for (const vpage::DType dtype : {vpage::DType::kFloat32, vpage::DType::kFloat16, vpage::DType::kBFloat16}) {
    const size_t elem = dtype == vpage::DType::kFloat32 ? 4 : 2;
    for (const int64_t tokens : {1, 2, 3, 40}) {
      for (const int32_t d : {4099, 11008}) {
        const std::vector<float> values = random_values(tokens * 2 * d, 6.0f, static_cast<uint32_t>(d + tokens));
        std::vector<uint16_t> halves(values.size());
        for (size_t i = 0; i < values.size(); ++i) {
          halves[i] = dtype == vpage::DType::kFloat16 ? vpage::float_to_half(values[i])
                                                      : vpage::float_to_bfloat16(values[i]);
        }
        for (const bool gelu : {false, true}) {
          std::vector<std::vector<uint8_t>> outs;
          for (const int threads : {1, 2, 4}) {
            std::vector<uint8_t> out(tokens * d * elem, 0xff);  // NaN in every dtype
            vpage::SiluAndMulArgs a;
            a.out = out.data();
            a.x = dtype == vpage::DType::kFloat32 ? static_cast<const void*>(values.data()) : halves.data();
            a.num_tokens = tokens;
            a.d = d;
            a.dtype = dtype;
            gelu ? vpage::cpu::gelu_tanh_and_mul(a, threads) : vpage::cpu::silu_and_mul(a, threads);
            outs.push_back(std::move(out));
          }
          EXPECT_MSG(outs[1] == outs[0] && outs[2] == outs[0],
                     std::string(gelu ? "gelu_tanh" : "silu") + "_and_mul dtype " +
                         std::to_string(static_cast<int>(dtype)) + ", " + std::to_string(tokens) + " tokens, d " +
                         std::to_string(d));
          bool any_nan = false;
          for (size_t i = 0; i < outs[0].size(); i += elem) {
            const uint16_t hi = static_cast<uint16_t>(outs[0][i + elem - 2] | (outs[0][i + elem - 1] << 8));
            any_nan = any_nan || hi == 0xffff;
          }
          EXPECT_MSG(!any_nan, "an output left unwritten");
        }
      }
    }
  }
}

TEST_CASE("gelu_tanh_and_mul against double") {
  const int64_t tokens = 11;
  for (const int32_t d : {1, 7, 33, 4099}) {
    const std::vector<float> gate_up = random_values(tokens * 2 * d, 6.0f, d);
    std::vector<float> out(tokens * d, NAN);
    vpage::GeluTanhAndMulArgs a;
    a.out = out.data();
    a.x = gate_up.data();
    a.num_tokens = tokens;
    a.d = d;
    vpage::cpu::gelu_tanh_and_mul(a, 2);
    double worst = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int32_t i = 0; i < d; ++i) {
        const double g = gate_up[t * 2 * d + i], u = gate_up[t * 2 * d + d + i];
        // 0.5 g (1 + tanh(z / 2)) = g / (1 + exp(-z)), without double's own cancellation
        const double z = 2.0 * std::sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g);
        const double ref = g / (1.0 + std::exp(-z)) * u;
        const double bound = (2e-6 + 2e-7 * std::fabs(z)) * std::fabs(ref) + 1e-30;
        worst = std::max(worst, std::fabs(out[t * d + i] - ref) / bound);
      }
    }
    EXPECT_MSG(worst <= 1.0, "gelu_tanh_and_mul vs double, d " + std::to_string(d) + ": " + std::to_string(worst) +
                                 " of the bound");
  }
}

TEST_CASE("rms_norm_heads on strided rows: each head as rms_norm's row, the rest untouched") {
  const int64_t tokens = 9;
  for (const int32_t head_size : {64, 80, 128, 256}) {
    const int32_t num_heads = 3, offset = 5, stride = offset + num_heads * head_size + 7;
    std::vector<float> rows = random_values(tokens * stride, 3.0f, head_size);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int32_t i = offset + num_heads * head_size; i < stride; ++i) rows[t * stride + i] = NAN;
    }
    const std::vector<float> before = rows;
    const std::vector<float> weight = random_values(head_size, 2.0f, 1);
    vpage::RmsNormHeadsArgs a;
    a.x = rows.data() + offset;
    a.row_stride = stride;
    a.weight = weight.data();
    a.num_tokens = tokens;
    a.num_heads = num_heads;
    a.head_size = head_size;
    a.eps = 1e-6f;
    vpage::cpu::rms_norm_heads(a, 2);
    bool same_as_rows = true, rest_untouched = true;
    double worst = 0;
    std::vector<float> row_out(head_size);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int32_t h = 0; h < num_heads; ++h) {
        const float* head = before.data() + t * stride + offset + h * head_size;
        vpage::RmsNormArgs r;
        r.out = row_out.data();
        r.x = head;
        r.weight = weight.data();
        r.num_tokens = 1;
        r.hidden_size = head_size;
        r.eps = 1e-6f;
        vpage::cpu::rms_norm(r, 1);
        double sum = 0;
        for (int32_t i = 0; i < head_size; ++i) sum += static_cast<double>(head[i]) * head[i];
        const double inv = 1.0 / std::sqrt(sum / head_size + 1e-6);
        for (int32_t i = 0; i < head_size; ++i) {
          const float got = rows[t * stride + offset + h * head_size + i];
          same_as_rows = same_as_rows && got == row_out[i];
          const double ref = head[i] * inv * weight[i];
          worst = std::max(worst, std::fabs(got - ref) / (std::fabs(ref) + 1e-6));
        }
      }
      for (int32_t i = 0; i < offset; ++i) {
        rest_untouched = rest_untouched && rows[t * stride + i] == before[t * stride + i];
      }
      for (int32_t i = offset + num_heads * head_size; i < stride; ++i) {
        rest_untouched = rest_untouched && std::isnan(rows[t * stride + i]);
      }
    }
    const std::string where = ", head_size " + std::to_string(head_size);
    EXPECT_MSG(same_as_rows, "rms_norm_heads differs from rms_norm on the head" + where);
    EXPECT_MSG(rest_untouched, "rms_norm_heads wrote outside the heads" + where);
    EXPECT_MSG(worst < 2e-6, "rms_norm_heads vs double" + where + ": " + std::to_string(worst));
  }
  vpage::RmsNormHeadsArgs bad;
  std::vector<float> x(64);
  bad.x = x.data();
  bad.num_tokens = 2;
  bad.num_heads = 2;
  bad.head_size = 16;
  bad.row_stride = 31;  // rows would overlap
  EXPECT_THROWS_WITH(vpage::cpu::rms_norm_heads(bad, 1), vpage::CheckError, "rms_norm_heads: bad sizes");
}

TEST_CASE("rotary_embedding with rotary_dim < head_size rotates only the first dims") {
  const int64_t tokens = 37, max_position = 64;
  for (const int32_t head_size : {64, 96}) {
    for (const int32_t rotary_dim : {16, 32}) {
      const int32_t num_heads = 5, half = rotary_dim / 2, stride = num_heads * head_size + 3;
      std::vector<float> cos_sin(max_position * rotary_dim);
      for (int64_t p = 0; p < max_position; ++p) {
        for (int32_t i = 0; i < half; ++i) {
          const double angle = p * std::pow(10000.0, -2.0 * i / rotary_dim);
          cos_sin[p * rotary_dim + i] = static_cast<float>(std::cos(angle));
          cos_sin[p * rotary_dim + half + i] = static_cast<float>(std::sin(angle));
        }
      }
      std::vector<int64_t> positions(tokens);
      for (int64_t t = 0; t < tokens; ++t) positions[t] = (t * 7 + 3) % max_position;
      std::vector<float> x = random_values(tokens * stride, 2.0f, rotary_dim + head_size);
      const std::vector<float> before = x;
      vpage::RotaryArgs a;
      a.x = x.data();
      a.row_stride = stride;
      a.positions = positions.data();
      a.cos_sin = cos_sin.data();
      a.max_position = max_position;
      a.num_tokens = tokens;
      a.num_heads = num_heads;
      a.head_size = head_size;
      a.rotary_dim = rotary_dim;
      vpage::cpu::rotary_embedding(a, 2);
      bool exact = true, rest_untouched = true;
      for (int64_t t = 0; t < tokens; ++t) {
        const float* c = cos_sin.data() + positions[t] * rotary_dim;
        for (int32_t h = 0; h < num_heads; ++h) {
          const int64_t head = t * stride + h * head_size;
          for (int32_t i = 0; i < half; ++i) {
            const float x1 = before[head + i], x2 = before[head + half + i];
            // float32 with the roundings of torch's unfused x * cos - rotate_half(x) * sin
            const float m1 = x1 * c[i], m2 = x2 * c[half + i], m3 = x2 * c[i], m4 = x1 * c[half + i];
            exact = exact && x[head + i] == m1 - m2 && x[head + half + i] == m3 + m4;
          }
          for (int32_t i = rotary_dim; i < head_size; ++i) {
            rest_untouched = rest_untouched && x[head + i] == before[head + i];
          }
        }
        for (int32_t i = num_heads * head_size; i < stride; ++i) {
          rest_untouched = rest_untouched && x[t * stride + i] == before[t * stride + i];
        }
      }
      const std::string where = " (head_size " + std::to_string(head_size) + ", rotary_dim " +
                                std::to_string(rotary_dim) + ")";
      EXPECT_MSG(exact, "partial rotary differs from the float32 formula" + where);
      EXPECT_MSG(rest_untouched, "partial rotary wrote past rotary_dim" + where);
    }
  }
  vpage::RotaryArgs bad;
  bad.head_size = 64;
  bad.rotary_dim = 66;
  EXPECT_THROWS_WITH(vpage::cpu::rotary_embedding(bad, 1), vpage::CheckError, "rotary_dim 66");
  bad.rotary_dim = 15;
  EXPECT_THROWS_WITH(vpage::cpu::rotary_embedding(bad, 1), vpage::CheckError, "rotary_dim 15");
}

TEST_MAIN()
