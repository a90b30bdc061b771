// vpage::cpu::dense_pack / dense_matmul: the packed layout, every weight dtype (float32,
// bfloat16, float16) and activation dtype against a double-precision matmul of the same values,
// in every instruction set the CPU has (bf16 dot products where it has AVX512-BF16), on awkward sizes (partial panels, k not a multiple of
// anything, row counts around the micro-kernel's and the row block's); each row bit-identical
// to a single-row call and across 1, 2 and 3 threads; poisoned output stays outside [m, n];
// bad arguments throw.
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
#include "vpage/kernels/half.h"

namespace {

using vpage::DType;

// Values of `dtype` as 16-bit or 32-bit storage, plus the float value each one holds.
struct Values {
  std::vector<uint16_t> half;
  std::vector<float> exact;
  const void* data(DType dtype) const {
    return dtype == DType::kFloat32 ? static_cast<const void*>(exact.data()) : half.data();
  }
};

Values random_values(size_t count, DType dtype, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Values v;
  v.exact.resize(count);
  v.half.resize(count);
  for (size_t i = 0; i < count; ++i) {
    const float f = dist(rng);
    if (dtype == DType::kBFloat16) {
      v.half[i] = vpage::float_to_bfloat16(f);
      v.exact[i] = vpage::bfloat16_to_float(v.half[i]);
    } else if (dtype == DType::kFloat16) {
      v.half[i] = vpage::float_to_half(f);
      v.exact[i] = vpage::half_to_float(v.half[i]);
    } else {
      v.exact[i] = f;
    }
  }
  return v;
}

std::vector<char> pack(DType dtype, const Values& w, int n, int k, int threads) {
  std::vector<char> packed(static_cast<size_t>(vpage::dense_packed_elements(n, k)) * vpage::dtype_size(dtype), 'x');
  vpage::cpu::dense_pack(dtype, w.data(dtype), n, k, k, packed.data(), threads);
  return packed;
}

float out_value(DType dtype, const std::vector<float>& out32, const std::vector<uint16_t>& out16, size_t i) {
  if (dtype == DType::kFloat32) return out32[i];
  return dtype == DType::kBFloat16 ? vpage::bfloat16_to_float(out16[i]) : vpage::half_to_float(out16[i]);
}

// out [m, n] with row stride n + 3 (the 3 extra columns poisoned), as float values; in x's
// dtype, or float32 with float32_out.
std::vector<float> run(DType dtype, DType weight_dtype, const Values& x, const std::vector<char>& packed,
                       const std::vector<float>* bias, int64_t m, int n, int k, int threads,
                       bool float32_out = false) {
  const DType out_dtype = float32_out ? DType::kFloat32 : dtype;
  const int64_t stride = n + 3;
  const float poison = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> out32(static_cast<size_t>(m * stride), poison);
  std::vector<uint16_t> out16(static_cast<size_t>(m * stride), 0x7fc1);
  vpage::DenseMatmulArgs a;
  a.out = out_dtype == DType::kFloat32 ? static_cast<void*>(out32.data()) : out16.data();
  a.x = x.data(dtype);
  a.weight = packed.data();
  a.bias = bias == nullptr ? nullptr : bias->data();
  a.m = m;
  a.n = n;
  a.k = k;
  a.x_stride = k;
  a.out_stride = stride;
  a.dtype = dtype;
  a.weight_dtype = weight_dtype;
  a.float32_out = float32_out;
  vpage::cpu::dense_matmul(a, threads);
  std::vector<float> out(static_cast<size_t>(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int j = 0; j < n + 3; ++j) {
      const float v = out_value(out_dtype, out32, out16, static_cast<size_t>(i * stride + j));
      if (j < n) {
        out[static_cast<size_t>(i * n + j)] = v;
      } else {
        EXPECT_MSG(std::isnan(v), "a column past n was written");
      }
    }
  }
  return out;
}

void check_case(DType dtype, DType weight_dtype, int64_t m, int n, int k, bool with_bias, std::mt19937& rng,
                bool float32_out = false) {
  const Values x = random_values(static_cast<size_t>(m * k), dtype, rng);
  const Values w = random_values(static_cast<size_t>(n) * k, weight_dtype, rng);
  std::vector<float> bias(static_cast<size_t>(n));
  for (float& b : bias) b = std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
  const std::vector<char> packed = pack(weight_dtype, w, n, k, 2);
  const std::vector<float>* b = with_bias ? &bias : nullptr;
  const std::vector<float> out = run(dtype, weight_dtype, x, packed, b, m, n, k, 2, float32_out);
  // float32 accumulation of k products: within k * 2^-23 of the sum of |products| (plus the
  // output's rounding to 16 bits).
  const DType out_dtype = float32_out ? DType::kFloat32 : dtype;
  const double out_eps =
      out_dtype == DType::kFloat32 ? 0.0 : (out_dtype == DType::kBFloat16 ? 1.0 / 256 : 1.0 / 2048);
  for (int64_t i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double ref = with_bias ? bias[j] : 0.0, magnitude = std::fabs(ref);
      for (int t = 0; t < k; ++t) {
        const double p = static_cast<double>(x.exact[i * k + t]) * w.exact[static_cast<size_t>(j) * k + t];
        ref += p;
        magnitude += std::fabs(p);
      }
      const double got = out[static_cast<size_t>(i * n + j)];
      const double bound = (k + 2) * 1.2e-7 * magnitude + out_eps * std::fabs(ref) + 1e-30;
      EXPECT_MSG(std::fabs(got - ref) <= bound,
                 "m " + std::to_string(m) + " n " + std::to_string(n) + " k " + std::to_string(k) + ": got " +
                     std::to_string(got) + ", want " + std::to_string(ref));
    }
  }
  for (int threads : {1, 3}) {
    EXPECT(run(dtype, weight_dtype, x, packed, b, m, n, k, threads, float32_out) == out);
  }
  // Batch invariance: rows 0 and m - 1 alone give the same bits.
  for (int64_t i : {int64_t{0}, m - 1}) {
    Values row;
    row.exact.assign(x.exact.begin() + i * k, x.exact.begin() + (i + 1) * k);
    row.half.assign(x.half.begin() + i * k, x.half.begin() + (i + 1) * k);
    const std::vector<float> single = run(dtype, weight_dtype, row, packed, b, 1, n, k, 2, float32_out);
    EXPECT(std::memcmp(single.data(), out.data() + i * n, sizeof(float) * n) == 0);
  }
}

TEST_CASE("dense_pack: panels of 32 rows, k-major, zeros past n") {
  std::mt19937 rng(1);
  const int n = 37, k = 5;
  const Values w = random_values(static_cast<size_t>(n) * k, DType::kFloat32, rng);
  const std::vector<char> bytes = pack(DType::kFloat32, w, n, k, 2);
  const float* packed = reinterpret_cast<const float*>(bytes.data());
  for (int p = 0; p < 2; ++p) {
    for (int j = 0; j < k; ++j) {
      for (int c = 0; c < 32; ++c) {
        const int row = 32 * p + c;
        const float want = row < n ? w.exact[static_cast<size_t>(row) * k + j] : 0.0f;
        EXPECT(packed[(p * k + j) * 32 + c] == want);
      }
    }
  }
}

TEST_CASE("dense_matmul: every weight and activation dtype, every ISA, awkward sizes") {
  vpage_test::AutoIsaOnExit restore;
  std::mt19937 rng(7);
  for (const std::string& isa : vpage_test::supported_isas()) {
    vpage::cpu::set_cpu_isa(isa);
    const std::string base = isa.substr(0, isa.find("vnni"));
    const std::string used = vpage::cpu::dense_matmul_isa();
    EXPECT_MSG(used == base || (base == "avx512" && used == "avx512bf16"), "dense_matmul_isa for " + isa);
    for (DType weight_dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
        check_case(dtype, weight_dtype, 1, 33, 257, true, rng);
        check_case(dtype, weight_dtype, 9, 64, 300, false, rng);
      }
      for (int64_t m : {2, 3, 4, 5, 6, 7, 8, 10, 12, 13, 260}) {
        check_case(DType::kFloat32, weight_dtype, m, 45, 129, m % 2 == 0, rng);
      }
      check_case(DType::kFloat32, weight_dtype, 5, 1, 1, true, rng);
      check_case(DType::kFloat32, weight_dtype, 11, 70, 520, true, rng);  // three k chunks
      check_case(DType::kBFloat16, weight_dtype, 260, 45, 129, true, rng);  // odd k: a last pair of one
      check_case(DType::kFloat16, weight_dtype, 3, 96, 600, true, rng);
      // Tasks of three panels of two chunks each (the next chunk a task fetches: inside a panel,
      // then the next panel's), and widened chunks, three per panel.
      check_case(DType::kBFloat16, weight_dtype, 3, 620, 300, true, rng);
      check_case(DType::kBFloat16, weight_dtype, 40, 100, 600, false, rng);
      // float32 outputs of 16-bit x (a 16-bit model's logits).
      for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        check_case(dtype, weight_dtype, 1, 70, 300, false, rng, true);
        check_case(dtype, weight_dtype, 13, 45, 129, true, rng, true);
      }
    }
  }
}

TEST_CASE("dense_matmul: bfloat16 outputs are the float32 results rounded, bit for bit") {
  // Full panels (stored in line) and a partial one, with and without bias (through
  // dense_store_out): both stores round as float_to_bfloat16 does. The float32 results: of the
  // same values as float32 x, and (on every path, bf16 dot products included) of bfloat16 x
  // with float32_out, which changes only the final store.
  vpage_test::AutoIsaOnExit restore;
  std::mt19937 rng(11);
  for (const std::string& isa : vpage_test::supported_isas()) {
    vpage::cpu::set_cpu_isa(isa);
    for (DType weight_dtype : {DType::kFloat32, DType::kBFloat16}) {
      // bf16 x bf16 runs bf16 dot products there, not float32 x's path.
      const bool bf16_dot =
          weight_dtype == DType::kBFloat16 && std::string(vpage::cpu::dense_matmul_isa()) == "avx512bf16";
      for (int64_t m : {1, 9, 260}) {
        const int n = 70, k = 300;
        const Values x = random_values(static_cast<size_t>(m * k), DType::kBFloat16, rng);
        const Values w = random_values(static_cast<size_t>(n) * k, weight_dtype, rng);
        std::vector<float> bias(static_cast<size_t>(n));
        for (float& b : bias) b = std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
        const std::vector<char> packed = pack(weight_dtype, w, n, k, 2);
        for (bool with_bias : {false, true}) {
          const std::vector<float>* b = with_bias ? &bias : nullptr;
          const std::vector<float> half = run(DType::kBFloat16, weight_dtype, x, packed, b, m, n, k, 2);
          const std::vector<float> out32 = run(DType::kBFloat16, weight_dtype, x, packed, b, m, n, k, 2, true);
          const std::vector<float> wide =
              bf16_dot ? std::vector<float>{} : run(DType::kFloat32, weight_dtype, x, packed, b, m, n, k, 2);
          for (size_t i = 0; i < half.size(); ++i) {
            EXPECT(half[i] == vpage::bfloat16_to_float(vpage::float_to_bfloat16(out32[i])));
            if (!bf16_dot) EXPECT(half[i] == vpage::bfloat16_to_float(vpage::float_to_bfloat16(wide[i])));
          }
        }
      }
    }
  }
}

TEST_CASE("dense_matmul: whole panels stored from the accumulators equal the per-row store") {
  // Without bias, the last k chunk stores whole panels from its accumulators; a zero bias sends
  // every row through dense_store_out. n = 70: two whole panels and one of 6 columns; one,
  // two and three k chunks; row counts for every row blocking (by threes, whole kernels and a
  // rest, widened 16-bit chunks); float32 and bfloat16 outputs (bf16 x bf16: bf16 dot
  // products where the CPU has them), float32 outputs of bfloat16 x.
  vpage_test::AutoIsaOnExit restore;
  std::mt19937 rng(13);
  for (const std::string& isa : vpage_test::supported_isas()) {
    vpage::cpu::set_cpu_isa(isa);
    for (DType weight_dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
        for (int64_t m : {1, 5, 9, 40, 260}) {
          for (int k : {200, 300, 600}) {
            const int n = 70;
            const Values x = random_values(static_cast<size_t>(m * k), dtype, rng);
            const Values w = random_values(static_cast<size_t>(n) * k, weight_dtype, rng);
            const std::vector<float> zero_bias(static_cast<size_t>(n), 0.0f);
            const std::vector<char> packed = pack(weight_dtype, w, n, k, 2);
            for (bool float32_out : {false, true}) {
              if (float32_out && dtype == DType::kFloat32) continue;
              const std::vector<float> in_line = run(dtype, weight_dtype, x, packed, nullptr, m, n, k, 2, float32_out);
              const std::vector<float> per_row =
                  run(dtype, weight_dtype, x, packed, &zero_bias, m, n, k, 2, float32_out);
              EXPECT_MSG(in_line == per_row, isa + " m " + std::to_string(m) + " k " + std::to_string(k));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("dense_matmul: bad arguments throw") {
  std::vector<float> buffer(64 * 32, 1.0f);
  vpage::DenseMatmulArgs a;
  a.out = buffer.data();
  a.x = buffer.data();
  a.weight = buffer.data();
  a.m = 1;
  a.n = 32;
  a.k = 8;
  a.x_stride = 4;
  a.out_stride = 32;
  EXPECT_THROWS_WITH(vpage::cpu::dense_matmul(a, 1), vpage::CheckError, "bad sizes");
  a.x_stride = 8;
  a.weight_dtype = static_cast<DType>(9);
  EXPECT_THROWS_WITH(vpage::cpu::dense_matmul(a, 1), vpage::CheckError, "unknown dtype");
  a.weight_dtype = DType::kFloat32;
  a.weight = nullptr;
  EXPECT_THROWS_WITH(vpage::cpu::dense_matmul(a, 1), vpage::CheckError, "null pointer");
  EXPECT_THROWS_WITH(vpage::cpu::dense_pack(DType::kFloat32, buffer.data(), 4, 8, 7, buffer.data(), 1),
                     vpage::CheckError, "bad sizes");
}

}  // namespace

TEST_MAIN()
