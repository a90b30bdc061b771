// vpage::cpu::quant_matmul over hand-written ggml blocks: Q8_0 and Q4_1 against a scalar
// reference of their layouts, every type against a double-precision matmul of
// quant_dequantize_rows, in every instruction set the CPU has, on every path (for the 32-value
// formats integer dot products up to kQuantIntegerPathRows rows, then the integer GEMM; float
// dot products below 128 rows, outer product from 128, for the K formats and with the GEMM
// off),
// bit-identical on 1, 2 and 3 threads, and the integer paths' rows bit-identical to single-row
// calls; bad arguments throw. (The Python tests check every layout against the
// gguf package.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "cpu_isas.h"
#include "quant_args.h"
#include "vpage/common.h"
#include "vpage/kernels/cpu_kernels.h"
#include "vpage/kernels/half.h"
#include "vpage/kernels/quant_matmul.h"

namespace {

using vpage::QuantType;
using vpage_test::matmul_args;

void put_f16(uint8_t* p, float v) {
  const uint16_t h = vpage::float_to_half(v);
  std::memcpy(p, &h, 2);
}

// Random blocks with moderate f16 scales at the format's scale offsets.
std::vector<uint8_t> random_rows(QuantType type, int n, int k, std::mt19937& rng) {
  const int blocks = k / vpage::quant_block_values(type), size = vpage::quant_block_bytes(type);
  std::vector<uint8_t> w(static_cast<size_t>(n) * blocks * size);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(1e-3f, 1e-2f);
  for (auto& b : w) b = static_cast<uint8_t>(byte(rng));
  for (size_t b = 0; b < w.size() / size; ++b) {
    uint8_t* block = w.data() + b * size;
    if (type == QuantType::kQ6_K) {
      put_f16(block + 208, scale(rng));
    } else {
      put_f16(block, scale(rng));
      if (type != QuantType::kQ4_0 && type != QuantType::kQ8_0) put_f16(block + 2, scale(rng));
    }
  }
  return w;
}

// Scalar reading of the Q8_0 and Q4_1 layouts.
float reference_value(QuantType type, const uint8_t* row, int i) {
  uint16_t h;
  if (type == QuantType::kQ8_0) {
    const uint8_t* b = row + (i / 32) * 34;
    std::memcpy(&h, b, 2);
    return vpage::half_to_float(h) * static_cast<float>(static_cast<int8_t>(b[2 + i % 32]));
  }
  const uint8_t* b = row + (i / 32) * 20;
  std::memcpy(&h, b, 2);
  const float d = vpage::half_to_float(h);
  std::memcpy(&h, b + 2, 2);
  const int j = i % 32;
  const int q = j < 16 ? (b[4 + j] & 15) : (b[4 + j - 16] >> 4);
  return d * static_cast<float>(q) + vpage::half_to_float(h);
}

// The integer paths (32-value formats: the decode path up to kQuantIntegerPathRows x rows, the
// GEMM up to gemm_rows) multiply x as rounded to 8 bits per 32 values; this is that rounding,
// written from its definition: d = max|x| / 127, q = round(x * 127 / max|x|), x' = d * q.
bool rounds_x(QuantType type, int64_t m, int64_t gemm_rows) {
  return (m <= vpage::cpu::kQuantIntegerPathRows || m <= gemm_rows) &&
         (type == QuantType::kQ4_0 || type == QuantType::kQ4_1 || type == QuantType::kQ8_0 || type == QuantType::kQ4_K);
}

std::vector<float> round_x_to_8_bits(const std::vector<float>& x) {
  std::vector<float> out(x.size());
  for (size_t b = 0; b < x.size(); b += 32) {
    float amax = 0.0f;
    for (size_t j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b + j]));
    const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (size_t j = 0; j < 32; ++j) out[b + j] = d * std::nearbyint(x[b + j] * inv);
  }
  return out;
}

void check_type(QuantType type, int n, int k, std::mt19937& rng, bool scalar_reference) {
  const std::vector<uint8_t> w = random_rows(type, n, k, rng);
  std::vector<float> dense(static_cast<size_t>(n) * k);
  vpage::cpu::quant_dequantize_rows(type, w.data(), n, k, dense.data());
  const int64_t row_bytes = static_cast<int64_t>(k / vpage::quant_block_values(type)) * vpage::quant_block_bytes(type);
  if (scalar_reference) {
    for (int r = 0; r < n; ++r) {
      for (int i = 0; i < k; ++i) {
        EXPECT(std::fabs(dense[static_cast<size_t>(r) * k + i] - reference_value(type, w.data() + r * row_bytes, i)) <=
               1e-6f);
      }
    }
  }
  std::normal_distribution<float> normal;
  const int64_t integer_rows = vpage::cpu::kQuantIntegerPathRows;
  for (int64_t gemm_rows : {vpage::cpu::kQuantIntegerGemmMaxRows, int64_t{64}, int64_t{0}}) {  // 0: GEMM off
    vpage::cpu::set_quant_integer_gemm_rows(gemm_rows);
    for (int64_t m : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}, int64_t{5}, int64_t{17}, integer_rows,
                      integer_rows + 1, int64_t{64}, int64_t{65}, int64_t{131}}) {
      std::vector<float> x(static_cast<size_t>(m) * k), out(static_cast<size_t>(m) * n, -1.0f);
      for (auto& v : x) v = normal(rng);
      // The reference multiplies what the kernel multiplies; the rounding itself is bounded:
      // every x moves by at most d / 2, and it must move (a path that skipped it would fail).
      const std::vector<float> x_ref = rounds_x(type, m, gemm_rows) ? round_x_to_8_bits(x) : x;
      double moved = 0.0;
      for (size_t t = 0; t < x.size(); ++t) moved = std::max(moved, static_cast<double>(std::fabs(x[t] - x_ref[t])));
      EXPECT(rounds_x(type, m, gemm_rows) ? moved > 0.0 && moved <= 4.0 / 127.0 : moved == 0.0);
      vpage::QuantMatmulArgs a = matmul_args(type, w.data(), x.data(), out.data(), m, n, k);
      vpage::cpu::quant_matmul(a, 2);
      // Each output is computed by one task in a fixed order: the same bits on any thread count.
      std::vector<float> out_threads(out.size());
      for (int threads : {1, 3}) {
        a.out = out_threads.data();
        vpage::cpu::quant_matmul(a, threads);
        EXPECT(std::memcmp(out_threads.data(), out.data(), sizeof(float) * out.size()) == 0);
      }
      // The integer paths compute every (weight row, x row) the same way: rows equal single-row calls.
      if (rounds_x(type, m, gemm_rows) && m > 1) {
        a.m = 1;
        for (int64_t i : {int64_t{0}, m / 2, m - 1}) {
          a.x = x.data() + i * k;
          a.out = out_threads.data();
          vpage::cpu::quant_matmul(a, 1);
          EXPECT(std::memcmp(out_threads.data(), out.data() + i * n, sizeof(float) * n) == 0);
        }
      }
      double scale = 0.0, worst = 0.0;
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          double ref = 0.0;
          for (int t = 0; t < k; ++t) {
            ref += static_cast<double>(x_ref[i * k + t]) * dense[static_cast<size_t>(j) * k + t];
          }
          scale = std::max(scale, std::fabs(ref));
          worst = std::max(worst, std::fabs(ref - out[i * n + j]));
        }
      }
      EXPECT(scale > 0.0 && worst <= 1e-5 * scale);
    }
  }
  vpage::cpu::set_quant_integer_gemm_rows(vpage::cpu::kQuantIntegerGemmMaxRows);
}

TEST_CASE("quant_matmul: every type, every ISA, decode and prefill paths") {
  const vpage_test::AutoIsaOnExit restore_isa;
  std::mt19937 rng(7);
  for (const std::string& isa : vpage_test::supported_isas()) {
    vpage::cpu::set_cpu_isa(isa);
    EXPECT(std::string(vpage::cpu::quant_matmul_isa()) == isa);
    check_type(QuantType::kQ8_0, 13, 96, rng, true);
    check_type(QuantType::kQ4_1, 13, 96, rng, true);
    check_type(QuantType::kQ4_0, 13, 96, rng, false);
    // The integer path's awkward shapes: n not a multiple of its 4-row tiles or of a task, one
    // block (no pair), an odd block count, several tasks.
    for (QuantType t : {QuantType::kQ4_0, QuantType::kQ4_1, QuantType::kQ8_0}) {
      for (int n : {1, 3, 17, 257}) check_type(t, n, n == 257 ? 160 : 32, rng, false);
      check_type(t, 67, 576, rng, false);
    }
    for (QuantType t : {QuantType::kQ4_K, QuantType::kQ5_K, QuantType::kQ6_K}) check_type(t, 13, 512, rng, false);
  }
}

// Rows of `type` without the quant kQ8_0x4 refuses (-128: its byte 0x80 becomes -127).
std::vector<uint8_t> x4_source_rows(QuantType type, int n, int k, std::mt19937& rng) {
  std::vector<uint8_t> w = random_rows(type, n, k, rng);
  if (type == QuantType::kQ8_0) {
    for (size_t b = 0; b < w.size(); b += 34) std::replace(w.begin() + b + 2, w.begin() + b + 34, uint8_t{0x80}, uint8_t{0x81});
  }
  return w;
}

// Q4_1 / Q8_0 rows repacked to their x4 or x8 type give bitwise the file type's results on
// every path: the x4 decode kernels (x86), the x8 ones (VNNI), the integer GEMM, and the other
// paths, which unpack a task's rows first.
void check_repacked(QuantType type, bool x8, int n, int k, std::mt19937& rng) {
  const QuantType packed_type = x8 ? vpage::cpu::quant_x8_type(type) : vpage::cpu::quant_x4_type(type);
  EXPECT(packed_type != type && vpage::cpu::quant_file_type(packed_type) == type);
  // x8 takes any Q8_0 quant; x4 none of -128.
  const std::vector<uint8_t> w = x8 ? random_rows(type, n, k, rng) : x4_source_rows(type, n, k, rng);
  std::vector<uint8_t> packed(w.size(), 0xAB), unpacked(w.size(), 0xCD);
  if (x8) {
    vpage::cpu::quant_repack_x8(type, w.data(), n, k, packed.data());
  } else {
    EXPECT(vpage::cpu::quant_repack_x4(type, w.data(), n, k, packed.data()));
  }
  EXPECT(packed != w);
  vpage::cpu::quant_unpack_rows(packed_type, packed.data(), n, k, unpacked.data());
  EXPECT(unpacked == w);
  std::vector<float> dense(static_cast<size_t>(n) * k), dense_packed(dense.size(), -1.0f);
  vpage::cpu::quant_dequantize_rows(type, w.data(), n, k, dense.data());
  vpage::cpu::quant_dequantize_rows(packed_type, packed.data(), n, k, dense_packed.data());
  EXPECT(dense == dense_packed);
  std::normal_distribution<float> normal;
  for (int64_t gemm_rows : {vpage::cpu::kQuantIntegerGemmMaxRows, int64_t{0}}) {  // 0: float path beyond 16 rows
    vpage::cpu::set_quant_integer_gemm_rows(gemm_rows);
    for (int64_t m : {1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 16, 17, 64, 131}) {
      std::vector<float> x(static_cast<size_t>(m) * k), out(static_cast<size_t>(m) * n, -1.0f);
      std::vector<float> out_packed(out.size(), -2.0f);
      for (auto& v : x) v = normal(rng);
      vpage::QuantMatmulArgs a = matmul_args(type, w.data(), x.data(), out.data(), m, n, k);
      vpage::cpu::quant_matmul(a, 2);
      a.weight = packed.data();
      a.type = packed_type;
      for (int threads : {1, 2, 3}) {
        a.out = out_packed.data();
        vpage::cpu::quant_matmul(a, threads);
        EXPECT(std::memcmp(out_packed.data(), out.data(), sizeof(float) * out.size()) == 0);
      }
    }
  }
  vpage::cpu::set_quant_integer_gemm_rows(vpage::cpu::kQuantIntegerGemmMaxRows);
}

TEST_CASE("quant_matmul: x4 rows equal their Q4_1 / Q8_0 rows bitwise, every ISA and path") {
  const vpage_test::AutoIsaOnExit restore_isa;
  std::mt19937 rng(11);
  for (const std::string& isa : vpage_test::supported_isas()) {
    vpage::cpu::set_cpu_isa(isa);
    // One group; groups past a chunk of four; several tasks with a short last one.
    for (const auto& [n, k] : {std::pair{4, 64}, std::pair{36, 576}, std::pair{260, 128}, std::pair{20, 1536}}) {
      check_repacked(QuantType::kQ4_1, false, n, k, rng);
      check_repacked(QuantType::kQ8_0, false, n, k, rng);
    }
  }
}

TEST_CASE("quant_matmul: x8 rows equal their Q4_1 / Q8_0 rows bitwise, every ISA and path") {
  const vpage_test::AutoIsaOnExit restore_isa;
  std::mt19937 rng(13);
  for (const std::string& isa : vpage_test::supported_isas()) {
    vpage::cpu::set_cpu_isa(isa);
    // One group, one block; an odd block count; groups past a step of four streams; several
    // tasks with a short last one.
    for (const auto& [n, k] : {std::pair{8, 32}, std::pair{40, 96}, std::pair{72, 576}, std::pair{264, 128},
                               std::pair{24, 1536}}) {
      check_repacked(QuantType::kQ4_1, true, n, k, rng);
      check_repacked(QuantType::kQ8_0, true, n, k, rng);
    }
  }
}

TEST_CASE("quant_repack_x4: a Q8_0 quant of -128 keeps the file's layout") {
  std::mt19937 rng(3);
  std::vector<uint8_t> w = x4_source_rows(QuantType::kQ8_0, 8, 128, rng);
  std::vector<uint8_t> packed(w.size(), 0xAB);
  w[34 * 9 + 2 + 17] = 0x80;  // row 2, block 1, quant 17
  EXPECT(!vpage::cpu::quant_repack_x4(QuantType::kQ8_0, w.data(), 8, 128, packed.data()));
  EXPECT(std::all_of(packed.begin(), packed.end(), [](uint8_t b) { return b == 0xAB; }));
  w[34 * 9 + 2 + 17] = 0x7f;
  EXPECT(vpage::cpu::quant_repack_x4(QuantType::kQ8_0, w.data(), 8, 128, packed.data()));
}

TEST_CASE("quant_matmul: bad arguments throw") {
  std::vector<uint8_t> w(34 * 4);
  std::vector<float> x(64), out(4);
  vpage::QuantMatmulArgs a = matmul_args(QuantType::kQ8_0, w.data(), x.data(), out.data(), 1, 2, 64);
  vpage::cpu::quant_matmul(a, 1);
  a.k = 48;  // not whole blocks
  EXPECT_THROWS_WITH(vpage::cpu::quant_matmul(a, 1), vpage::CheckError, "bad sizes");
  a.k = 64;
  a.type = static_cast<QuantType>(6);  // Q5_0: not kept quantized
  EXPECT_THROWS_WITH(vpage::cpu::quant_matmul(a, 1), vpage::CheckError, "unsupported quantization type");
  EXPECT(!vpage::quant_type_supported(6) && vpage::quant_type_supported(14));
  std::vector<uint8_t> q4(20 * 2 * 6), packed(q4.size());
  EXPECT_THROWS_WITH(vpage::cpu::quant_repack_x4(QuantType::kQ4_1, q4.data(), 6, 64, packed.data()),
                     vpage::CheckError, "a multiple of 4 of them");
  EXPECT_THROWS_WITH(vpage::cpu::quant_repack_x4(QuantType::kQ4_1, q4.data(), 4, 96, packed.data()),
                     vpage::CheckError, "64 values per row");
  EXPECT_THROWS_WITH(vpage::cpu::quant_repack_x4(QuantType::kQ4_0, q4.data(), 4, 64, packed.data()),
                     vpage::CheckError, "Q4_1 or Q8_0 rows");
  a.weight = q4.data();
  a.n = 6;
  a.out_stride = 6;
  std::vector<float> out6(6);
  a.out = out6.data();
  a.type = QuantType::kQ4_1x4;
  EXPECT_THROWS_WITH(vpage::cpu::quant_matmul(a, 1), vpage::CheckError, "n a multiple of 4");
}

}  // namespace

TEST_MAIN()
