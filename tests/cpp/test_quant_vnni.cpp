// The VNNI form of the quantized matmul's integer paths (vpdpbusd: int32 products and
// reductions) against the AVX2 form (maddubs: int16 pair sums): both compute the same exact
// integer block sums, so every output must be bitwise equal, for Q4_0, Q4_1 (as in the file
// and repacked as Q4_1x4) and Q8_0, the decode and GEMM paths, awkward shapes. Checked on any AVX2 CPU through the emulated VNNI
// build (quant_vnni_emulated.cpp, whose add_dot4 is first checked against vpdpbusd's
// definition), and on a CPU with VNNI through the real avx512vnni / avx2vnni builds too.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "cpu_isas.h"
#include "quant_args.h"
#include "quant_task.h"
#include "vpage/common.h"
#include "vpage/kernels/cpu_kernels.h"
#include "vpage/kernels/half.h"

namespace vpage::cpu::vnni_emulated {
extern const QuantKernels kQuantKernels;
void add_dot4_bytes(const uint8_t* u8, const int8_t* s8, int32_t* acc);  // 32 bytes, 8 int32
}  // namespace vpage::cpu::vnni_emulated

namespace {

using vpage::QuantType;
using vpage::cpu::QuantKernels;
using vpage_test::has_isa;

// Random blocks: every byte random, then moderate f16 scales (and Q4_1 offsets) in the header.
std::vector<uint8_t> random_rows(QuantType type, int n, int k, std::mt19937& rng) {
  const int size = vpage::quant_block_bytes(type);
  std::vector<uint8_t> w(static_cast<size_t>(n) * (k / 32) * size);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(1e-3f, 1e-2f);
  for (auto& b : w) b = static_cast<uint8_t>(byte(rng));
  for (size_t b = 0; b < w.size() / size; ++b) {
    for (int h = 0; h < (type == QuantType::kQ4_1 ? 2 : 1); ++h) {
      const uint16_t f = vpage::float_to_half(scale(rng));
      std::memcpy(w.data() + b * size + 2 * h, &f, 2);
    }
  }
  return w;
}

// out [m, n] of one integer path (`gemm` or the decode path) of `kernels`, all tasks on this
// thread; x quantized by the AVX2 build (quantization does not involve VNNI).
std::vector<float> integer_path(const QuantKernels& kernels, bool gemm, QuantType type, const std::vector<uint8_t>& w,
                                const std::vector<float>& x, int64_t m, int32_t n, int32_t k) {
  const int32_t blocks = k / 32;
  std::vector<int8_t> q(static_cast<size_t>(m) * vpage::cpu::quant_x_row_bytes(k));
  std::vector<float> d(static_cast<size_t>(m) * blocks), s(d.size());
  std::vector<int32_t> sums(d.size());
  std::vector<float> pairs(static_cast<size_t>((m + 3) / 4 * vpage::cpu::quant_x_group_floats(blocks)));
  vpage::cpu::avx2::kQuantKernels.quantize_x(x.data(), k, m, k, q.data(), d.data(), s.data(), sums.data());
  vpage::cpu::quant_x_pairs(type, d.data(), s.data(), m, blocks, pairs.data());
  const vpage::cpu::QuantizedX qx{q.data(), vpage::cpu::quant_x_row_bytes(k), d.data(), s.data(), pairs.data(),
                                  sums.data()};
  std::vector<float> out(static_cast<size_t>(m) * n, std::nanf(""));  // poisoned
  const vpage::QuantMatmulArgs a = vpage_test::matmul_args(type, w.data(), x.data(), out.data(), m, n, k);
  const int32_t rows_per_task = 32;  // several tasks for n = 67
  const auto run = gemm ? kernels.run_gemm_task : kernels.run_dot_task;
  for (int64_t task = 0; task * rows_per_task < n; ++task) run(a, qx, rows_per_task, task);
  return out;
}

TEST_CASE("set_cpu_isa: levels by name, auto = the best supported, unknown names refused") {
  vpage::cpu::set_cpu_isa("auto");
  const std::string best = vpage::cpu::cpu_isa();
  EXPECT(std::string(vpage::cpu::quant_matmul_isa()) == best);
  for (const char* isa : {"avx512vnni", "avx512", "avx2vnni", "avx2"}) {
    if (isa == best) break;  // levels above the best one are unsupported here
    EXPECT(!has_isa(isa));
  }
  EXPECT_THROWS_WITH(vpage::cpu::set_cpu_isa("avx1024"), vpage::CheckError, "generic");  // names the levels
  EXPECT(vpage::cpu::cpu_isa() == best);  // unchanged by the refusal
}

TEST_CASE("emulated add_dot4 is vpdpbusd: acc + sums of 4 unsigned x signed byte products") {
  if (!has_isa("avx2")) return;
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> byte(0, 255), acc_value(-1 << 20, 1 << 20);
  for (int trial = 0; trial < 200; ++trial) {
    uint8_t u[32];
    int8_t s[32];
    int32_t acc[8], expected[8];
    for (int i = 0; i < 32; ++i) {
      // Extremes included: u 255 with s -128 is the widest product (-32640).
      u[i] = static_cast<uint8_t>(trial < 4 ? (trial % 2 ? 255 : 0) : byte(rng));
      s[i] = static_cast<int8_t>(trial < 4 ? (trial < 2 ? -128 : 127) : byte(rng) - 128);
    }
    for (int j = 0; j < 8; ++j) {
      acc[j] = acc_value(rng);
      expected[j] = acc[j];
      for (int i = 4 * j; i < 4 * j + 4; ++i) expected[j] += static_cast<int32_t>(u[i]) * s[i];
    }
    vpage::cpu::vnni_emulated::add_dot4_bytes(u, s, acc);
    EXPECT(std::memcmp(acc, expected, sizeof(acc)) == 0);
  }
}

TEST_CASE("integer paths: the VNNI form is bitwise the AVX2 form (emulated, and real where the CPU has VNNI)") {
  if (!has_isa("avx2")) return;
  std::vector<const QuantKernels*> vnni = {&vpage::cpu::vnni_emulated::kQuantKernels};
  if (has_isa("avx512vnni")) vnni.push_back(&vpage::cpu::avx512vnni::kQuantKernels);
  if (has_isa("avx2vnni")) vnni.push_back(&vpage::cpu::avx2vnni::kQuantKernels);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (QuantType type : {QuantType::kQ4_0, QuantType::kQ4_1, QuantType::kQ8_0}) {
    // k: one block (no pair), an odd block count, the default model's widths.
    for (int32_t k : {32, 96, 576, 1536}) {
      for (int32_t n : {1, 3, 17, 67}) {
        const std::vector<uint8_t> w = random_rows(type, n, k, rng);
        for (int64_t m : {1, 3, 4, 5, 16, 17, 40}) {
          std::vector<float> x(static_cast<size_t>(m) * k);
          for (auto& v : x) v = normal(rng);
          for (bool gemm : {false, true}) {
            const std::vector<float> want = integer_path(vpage::cpu::avx2::kQuantKernels, gemm, type, w, x, m, n, k);
            for (const QuantKernels* kernels : vnni) {
              const std::vector<float> got = integer_path(*kernels, gemm, type, w, x, m, n, k);
              EXPECT_MSG(std::memcmp(got.data(), want.data(), sizeof(float) * want.size()) == 0,
                         std::string(kernels->name) + (gemm ? " gemm" : " decode") + " type " +
                             std::to_string(static_cast<int>(type)) + " m " + std::to_string(m) + " n " +
                             std::to_string(n) + " k " + std::to_string(k) + ": not bitwise the avx2 result");
            }
          }
        }
      }
    }
  }
  // Q4_1 / Q8_0 rows repacked as x4 (both paths read that layout directly): the file layout's bits.
  std::vector<const QuantKernels*> x4_kernels = vnni;
  x4_kernels.push_back(&vpage::cpu::avx2::kQuantKernels);
  for (QuantType type : {QuantType::kQ4_1, QuantType::kQ8_0}) {
    const QuantType x4 = vpage::cpu::quant_x4_type(type);
    for (int32_t k : {576, 1536}) {
      const int32_t n = 68;
      std::vector<uint8_t> w = random_rows(type, n, k, rng);
      if (type == QuantType::kQ8_0) {  // no quant of -128, which keeps Q8_0 rows unpacked
        for (size_t b = 0; b < w.size(); b += 34) std::replace(w.begin() + b + 2, w.begin() + b + 34, uint8_t{0x80}, uint8_t{0x81});
      }
      std::vector<uint8_t> packed(w.size());
      EXPECT(vpage::cpu::quant_repack_x4(type, w.data(), n, k, packed.data()));
      for (int64_t m : {1, 5, 17}) {
        std::vector<float> x(static_cast<size_t>(m) * k);
        for (auto& v : x) v = normal(rng);
        for (bool gemm : {false, true}) {
          const std::vector<float> want = integer_path(vpage::cpu::avx2::kQuantKernels, gemm, type, w, x, m, n, k);
          for (const QuantKernels* kernels : x4_kernels) {
            const std::vector<float> got = integer_path(*kernels, gemm, x4, packed, x, m, n, k);
            EXPECT_MSG(std::memcmp(got.data(), want.data(), sizeof(float) * want.size()) == 0,
                       std::string(kernels->name) + (gemm ? " gemm" : " decode") + " x4 type " +
                           std::to_string(static_cast<int>(type)) + " m " + std::to_string(m) + " k " +
                           std::to_string(k) + ": not bitwise the file layout's result");
          }
        }
      }
    }
  }
  // Rows repacked as x8: the VNNI decode kernel reads them at any m, every SIMD GEMM too.
  for (QuantType type : {QuantType::kQ4_1, QuantType::kQ8_0}) {
    const QuantType x8 = vpage::cpu::quant_x8_type(type);
    for (int32_t k : {96, 576}) {
      const int32_t n = 72;
      const std::vector<uint8_t> w = random_rows(type, n, k, rng);
      std::vector<uint8_t> packed(w.size());
      vpage::cpu::quant_repack_x8(type, w.data(), n, k, packed.data());
      for (int64_t m : {1, 2, 5, 9, 17, 70}) {
        std::vector<float> x(static_cast<size_t>(m) * k);
        for (auto& v : x) v = normal(rng);
        for (bool gemm : {false, true}) {
          const std::vector<float> want = integer_path(vpage::cpu::avx2::kQuantKernels, gemm, type, w, x, m, n, k);
          for (const QuantKernels* kernels : x4_kernels) {
            if (!gemm && !kernels->integer_x8) continue;
            const std::vector<float> got = integer_path(*kernels, gemm, x8, packed, x, m, n, k);
            EXPECT_MSG(std::memcmp(got.data(), want.data(), sizeof(float) * want.size()) == 0,
                       std::string(kernels->name) + (gemm ? " gemm" : " decode") + " x8 type " +
                           std::to_string(static_cast<int>(type)) + " m " + std::to_string(m) + " k " +
                           std::to_string(k) + ": not bitwise the file layout's result");
          }
        }
      }
    }
  }
}

}  // namespace

TEST_MAIN()
