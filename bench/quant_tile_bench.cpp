// vpage-bench-quant-tile: the AVX2 integer micro-kernels of the quantized matmul alone, one
// thread, no thread pool, no x quantization: where their cycles go on the CPU at hand.
//
//   vpage-bench-quant-tile --k 2048 --rows 16,256,4096 --repeats 7
//
// Prints, in cycles of the time-stamp counter (TSC; its rate is the CPU's nominal clock, not
// the core clock, which differs by the hour on a VM):
//  - dot:  the decode tile (quant_dot_impl.h, Q4_1, one x row) per 32-value block and weight
//          row, on --rows weight rows of k values (20 KiB at 16 rows: L1; 320 KiB: L2; 5 MiB:
//          L3 or memory);
//  - gemm: the GEMM tile (quant_gemm_impl.h, Q4_1) per pair iteration (2 unpacked weight rows
//          x 4 x rows x 2 blocks: 512 products), on a k = 576 tile of 64 rows (L2);
//  - products: the same iteration's 16 vpmaddubsw and their int16 adds alone (the floor that
//          the lane reductions and the scale step sit on);
//  - dot Q4_1x4: the decode tile (four groups side by side) on the same rows as the worker
//          repacks them (QuantType's kQ4_1x4: per block pair the four rows' f16 scales side by
//          side, then each row's two blocks of nibbles), checked to give the same results;
//  - dot task Q4_1x4 / Q8_0 / Q8_0x4, m x rows: the whole decode task (run_dot_task: x passes over
//          chunks of tiles, output store) at each of --m x rows, on 64 weight rows of k = 576
//          (L1/L2), per 32-value block, weight row and x row: what a speculative step's extra
//          verification rows cost once weights are in cache.
// Built from the kernels' own headers with their AVX2 flags (bench/CMakeLists.txt), x86 only;
// exits with a message on a CPU without AVX2.
#define VPAGE_ISA_NAMESPACE avx2
#include "kernels/quant_dot_task.h"
#include "kernels/quant_gemm_impl.h"

#include <x86intrin.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "bench_common.h"

namespace {

using vpage::QuantMatmulArgs;
using vpage::QuantType;
using namespace vpage::cpu;
using namespace vpage::cpu::avx2::qmm;

// Best of `repeats` runs of fn() (which does `units` units of work), in TSC cycles per unit.
template <typename Fn>
double best_tsc_per_unit(int repeats, double units, Fn&& fn) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const uint64_t start = __rdtsc();
    fn();
    best = std::min(best, static_cast<double>(__rdtsc() - start) / units);
  }
  return best;
}

// Q4_1 rows of random nibbles with finite f16 scales and offsets.
std::vector<uint8_t> q4_1_rows(int rows, int k, std::mt19937& rng) {
  const int blocks = k / 32;
  // Room for the tiles' prefetches past the last row (a prefetch into an unmapped page is slow).
  std::vector<uint8_t> w(static_cast<size_t>(rows + kPrefetchRows) * blocks * 20);
  for (uint8_t& v : w) v = static_cast<uint8_t>(rng());
  for (int b = 0; b < rows * blocks; ++b) {
    const uint16_t d = 0x2000 + (rng() & 0x3ff), m = 0x1800 + (rng() & 0x3ff);  // ~0.008, ~0.0005
    std::memcpy(&w[static_cast<size_t>(b) * 20], &d, 2);
    std::memcpy(&w[static_cast<size_t>(b) * 20 + 2], &m, 2);
  }
  return w;
}

// {GGUF layout, repacked}: TSC cycles per block and weight row; exits if their results differ.
std::pair<double, double> dot_cycles(int k, int rows, int repeats, std::mt19937& rng) {
  const int blocks = k / 32;
  const int64_t row_bytes = static_cast<int64_t>(blocks) * 20;
  const std::vector<uint8_t> w = q4_1_rows(rows, k, rng);
  std::vector<int8_t> xq(quant_x_row_bytes(k));
  for (int8_t& v : xq) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
  std::vector<float> pairs(quant_x_group_floats(blocks));
  for (float& v : pairs) v = 0.01f * static_cast<float>(rng() % 100 + 1);
  QuantizedX x;
  x.pairs = pairs.data();
  const float* spread = spread_pair_scales(x, 1, blocks);
  std::vector<uint8_t> repacked(static_cast<size_t>(rows + kCombos * kPrefetchRows) * row_bytes);  // + prefetch room
  quant_repack_x4(QuantType::kQ4_1, w.data(), rows, k, repacked.data());
  const int64_t group_bytes = static_cast<int64_t>(blocks / 2) * kQ4_1x4PairBytes;
  std::vector<float> out(rows), out_repacked(rows);
  const int passes = std::max(1, (1 << 21) / rows);
  const double units = static_cast<double>(passes) * rows * blocks;
  const double gguf = best_tsc_per_unit(repeats, units, [&] {
    for (int pass = 0; pass < passes; ++pass) {
      for (int r = 0; r + 4 <= rows; r += 4) {
        const uint8_t* tile[kCombos] = {&w[r * row_bytes], &w[(r + 1) * row_bytes], &w[(r + 2) * row_bytes],
                                        &w[(r + 3) * row_bytes]};
        dot_tile<QuantType::kQ4_1, 1>(tile, kPrefetchRows * row_bytes, blocks, xq.data(), 0, spread, 0,
                                      out.data() + r, 1);
      }
    }
  });
  const double packed = best_tsc_per_unit(repeats, units, [&] {
    for (int pass = 0; pass < passes; ++pass) {
      for (int r = 0; r + 16 <= rows; r += 16) {  // four groups side by side, as the decode task reads them
        const uint8_t* groups[kDotStreams];
        for (int j = 0; j < kDotStreams; ++j) groups[j] = &repacked[(r / 4 + j) * group_bytes];
        dot_tile_x4_streams<QuantType::kQ4_1x4, 1>(groups, blocks, xq.data(), 0, spread, 0, out_repacked.data() + r);
      }
    }
  });
  if (out != out_repacked) {
    std::printf("the repacked tile's results differ\n");
    std::exit(1);
  }
  return {gguf, packed};
}

double gemm_cycles(int repeats, std::mt19937& rng) {
  constexpr int kPairs = 9, kTileRows = 64;  // k = 576
  std::vector<WeightPair<QuantType::kQ4_1>> tile(kPairs * kTileRows);
  const std::vector<uint8_t> w = q4_1_rows(kTileRows, 64 * kPairs, rng);
  unpack_weight_rows<QuantType::kQ4_1>(w.data(), kPairs * 40, kTileRows, 2 * kPairs, tile.data());
  std::vector<int8_t> xq(4 * 64 * kPairs);
  for (int8_t& v : xq) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
  std::vector<float> xp(kPairs * kXPairFloats);
  for (float& v : xp) v = 0.01f * static_cast<float>(rng() % 100 + 1);
  const int8_t* x[kCombos] = {xq.data(), xq.data() + 64 * kPairs, xq.data() + 128 * kPairs, xq.data() + 192 * kPairs};
  std::vector<float> out(4 * kTileRows);
  const int passes = 20000;
  return best_tsc_per_unit(repeats, static_cast<double>(passes) * (kTileRows / 2) * kPairs, [&] {
    for (int pass = 0; pass < passes; ++pass) {
      for (int r = 0; r < kTileRows; r += 2) {
        gemm_tile<QuantType::kQ4_1, 2>(tile.data() + r * kPairs, kPairs, x, xp.data(), 4, out.data() + r, kTileRows);
      }
    }
  });
}

// gemm_cycles' 16 vpmaddubsw per iteration with an int16 add each, nothing else.
double product_cycles(int repeats, std::mt19937& rng) {
  alignas(32) static uint8_t w[64 * 18];
  alignas(32) static int8_t xq[4 * 64 * 9];
  for (uint8_t& v : w) v = rng() & 15;
  for (int8_t& v : xq) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
  __m256i acc[8];
  for (__m256i& a : acc) a = _mm256_setzero_si256();
  const int passes = 100000;
  const double cycles = best_tsc_per_unit(repeats, passes * 9.0, [&] {
    for (int pass = 0; pass < passes; ++pass) {
      for (int p = 0; p < 9; ++p) {
        const __m256i* w0 = reinterpret_cast<const __m256i*>(w + 128 * (p % 9));
        const __m256i w0l = _mm256_load_si256(w0), w0h = _mm256_load_si256(w0 + 1);
        const __m256i w1l = _mm256_load_si256(w0 + 2), w1h = _mm256_load_si256(w0 + 3);
        for (int i = 0; i < 4; ++i) {
          const __m256i* xi = reinterpret_cast<const __m256i*>(xq + i * 64 * 9 + 64 * p);
          const __m256i xl = _mm256_loadu_si256(xi), xh = _mm256_loadu_si256(xi + 1);
          acc[2 * i] = _mm256_add_epi16(acc[2 * i], _mm256_add_epi16(_mm256_maddubs_epi16(w0l, xl),
                                                                     _mm256_maddubs_epi16(w0h, xh)));
          acc[2 * i + 1] = _mm256_add_epi16(acc[2 * i + 1], _mm256_add_epi16(_mm256_maddubs_epi16(w1l, xl),
                                                                             _mm256_maddubs_epi16(w1h, xh)));
        }
      }
    }
  });
  __m256i sum = acc[0];
  for (int i = 1; i < 8; ++i) sum = _mm256_add_epi16(sum, acc[i]);
  if (_mm256_extract_epi16(sum, 0) == 12345) std::printf(" ");  // keep the sums alive
  return cycles;
}


// run_dot_task on 64 rows of k = 576 (type Q4_1x4, Q8_0 or Q8_0x4) against m x rows: TSC
// cycles per block, weight row and x row.
double dot_task_cycles(QuantType type, int m, int repeats, std::mt19937& rng) {
  constexpr int kRows = 64, kK = 576, kBlocks = kK / 32;
  const int block_bytes = quant_block_bytes(type);
  std::vector<uint8_t> w(static_cast<size_t>(kRows + kCombos * kPrefetchRows) * kBlocks * block_bytes);
  for (uint8_t& v : w) v = static_cast<uint8_t>(rng() % 255 + 1);  // no 0x80: a Q8_0 quant of -128
  for (int b = 0; b < kRows * kBlocks; ++b) {
    const uint16_t d = 0x2000 + (rng() & 0x3ff);
    std::memcpy(&w[static_cast<size_t>(b) * block_bytes], &d, 2);
  }
  if (type == QuantType::kQ4_1x4) {
    const std::vector<uint8_t> gguf = q4_1_rows(kRows, kK, rng);
    quant_repack_x4(QuantType::kQ4_1, gguf.data(), kRows, kK, w.data());
  } else if (type == QuantType::kQ8_0x4) {
    const std::vector<uint8_t> gguf(w.begin(), w.begin() + static_cast<int64_t>(kRows) * kBlocks * block_bytes);
    quant_repack_x4(QuantType::kQ8_0, gguf.data(), kRows, kK, w.data());
  }
  std::vector<float> xf(static_cast<size_t>(m) * kK);
  for (float& v : xf) v = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f;
  std::vector<int8_t> xq(static_cast<size_t>(m) * quant_x_row_bytes(kK));
  std::vector<float> xd(static_cast<size_t>(m) * kBlocks), xs(xd.size());
  std::vector<int32_t> sums(xd.size());
  std::vector<float> pairs(static_cast<size_t>((m + 3) / 4) * quant_x_group_floats(kBlocks));
  quantize_rows_q8(xf.data(), kK, m, kK, xq.data(), xd.data(), xs.data(), sums.data());
  quant_x_pairs(type, xd.data(), xs.data(), m, kBlocks, pairs.data());
  const QuantizedX x{xq.data(), quant_x_row_bytes(kK), xd.data(), xs.data(), pairs.data(), sums.data()};
  std::vector<float> out(static_cast<size_t>(m) * kRows);
  QuantMatmulArgs a;
  a.out = out.data();
  a.x = xf.data();
  a.weight = w.data();
  a.m = m;
  a.n = kRows;
  a.k = kK;
  a.x_stride = kK;
  a.out_stride = kRows;
  a.type = type;
  const int passes = std::max(1, 4000 / m);
  return best_tsc_per_unit(repeats, static_cast<double>(passes) * kRows * kBlocks * m, [&] {
    for (int pass = 0; pass < passes; ++pass) run_dot_task(a, x, kRows, 0);
  });
}

}  // namespace

int main(int argc, char** argv) {
  int k = 2048, repeats = 7;
  std::vector<int> rows = {16, 256, 4096}, ms = {1, 4, 5, 8};
  vpage_bench::parse_flags(argc, argv, "[--k 2048] [--rows 16,256,4096] [--m 1,4,5,8] [--repeats 7]",
                           {{"--k", [&](const std::string& v) { k = std::stoi(v); }},
                            {"--rows", [&](const std::string& v) { rows = vpage_bench::int_list(v); }},
                            {"--m", [&](const std::string& v) { ms = vpage_bench::int_list(v); }},
                            {"--repeats", [&](const std::string& v) { repeats = std::stoi(v); }}});
  const bool rows_ok = std::all_of(rows.begin(), rows.end(), [](int r) { return r >= 16 && r % 16 == 0; });
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || k % 64 != 0 || !rows_ok) {
    std::printf("needs a CPU with AVX2 and FMA, k a multiple of 64 and rows multiples of 16\n");
    return 2;
  }
  std::printf("# %s, one thread, TSC cycles\n", vpage_bench::machine_description().c_str());
  std::mt19937 rng(7);
  std::printf("| kernel | size | TSC cycles | per |\n|---|---|---:|---|\n");
  for (int r : rows) {
    const double kib = static_cast<double>(r) * (k / 32) * 20 / 1024;
    const auto [gguf, packed] = dot_cycles(k, r, repeats, rng);
    std::printf("| dot Q4_1, 1 x row | %d rows x %d (%.0f KiB) | %.2f | block and weight row |\n", r, k, kib, gguf);
    std::printf("| dot Q4_1x4, 1 x row | the same | %.2f | block and weight row |\n", packed);
  }
  std::printf("| gemm Q4_1 | 64 rows x 576 | %.1f | pair iteration (512 products) |\n", gemm_cycles(repeats, rng));
  std::printf("| 16 vpmaddubsw + adds | - | %.1f | the same iteration's products alone |\n",
              product_cycles(repeats, rng));
  for (int m : ms) {
    for (QuantType type : {QuantType::kQ4_1x4, QuantType::kQ8_0, QuantType::kQ8_0x4}) {
      const char* name = type == QuantType::kQ8_0 ? "Q8_0" : type == QuantType::kQ8_0x4 ? "Q8_0x4" : "Q4_1x4";
      std::printf("| dot task %s, %d x rows | 64 rows x 576 | %.2f | block, weight row and x row |\n", name, m,
                  dot_task_cycles(type, m, repeats, rng));
    }
  }
  return 0;
}
