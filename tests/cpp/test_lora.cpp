// vpage::cpu::lora_add against a double-precision reference of the same values: float32 and
// bfloat16 activations and weights, in every instruction set the CPU has, on awkward sizes
// (k 72 and 576, slices of 96/32/32 rows, ranks 1, 8 and 16 mixed across slots), with rows of
// no adapter, a slot without weights on the projection, an untargeted slice, rows in arbitrary
// slot order, strided x and out; each row bit-identical alone and across 1 and 3 threads;
// columns past n and rows without an adapter untouched; bad arguments throw before out changes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "cpu_isas.h"
#include "vpage/common.h"
#include "vpage/kernels/dense_matmul.h"
#include "vpage/kernels/half.h"
#include "vpage/kernels/lora.h"

namespace {

using vpage::DType;

// Values of `dtype` as stored (16-bit or float32 bytes) plus the float value each one holds.
struct Values {
  std::vector<uint16_t> half;
  std::vector<float> exact;
  const void* data(DType dtype) const {
    return dtype == DType::kFloat32 ? static_cast<const void*>(exact.data()) : half.data();
  }
  void* data(DType dtype) { return dtype == DType::kFloat32 ? static_cast<void*>(exact.data()) : half.data(); }
  float at(DType dtype, size_t i) const {
    return dtype == DType::kFloat32 ? exact[i] : vpage::bfloat16_to_float(half[i]);
  }
};

Values random_values(size_t count, DType dtype, std::mt19937& rng, float scale = 1.0f) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  Values v;
  v.exact.resize(count);
  v.half.resize(count);
  for (size_t i = 0; i < count; ++i) {
    const float f = dist(rng);
    v.half[i] = vpage::float_to_bfloat16(f);
    v.exact[i] = dtype == DType::kBFloat16 ? vpage::bfloat16_to_float(v.half[i]) : f;
  }
  return v;
}

std::vector<char> pack(DType dtype, const Values& w, int n, int k) {
  std::vector<char> packed(static_cast<size_t>(vpage::dense_packed_elements(n, k)) * vpage::dtype_size(dtype));
  vpage::cpu::dense_pack(dtype, w.data(dtype), n, k, k, packed.data(), 2);
  return packed;
}

// One slot's adapter: A [num_slices * rank, k], B_j [slice_rows[j], rank] (empty: untargeted).
struct Adapter {
  bool has_a = true;
  int rank = 0;
  Values a;
  std::vector<Values> b;
  std::vector<char> packed_a;
  std::vector<std::vector<char>> packed_b;
};

struct Problem {
  DType dtype, weight_dtype;
  int k;
  std::vector<int32_t> slice_rows;
  std::vector<Adapter> adapters;
  std::vector<vpage::LoraAdapterWeights> table;
  int n() const {
    int n = 0;
    for (int rows : slice_rows) n += rows;
    return n;
  }
};

// ranks[s] = 0: slot s has no A (leaves the projection alone); untargeted = {slot, slice}.
Problem make_problem(DType dtype, DType weight_dtype, int k, std::vector<int32_t> slice_rows, std::vector<int> ranks,
                     std::pair<int, int> untargeted, std::mt19937& rng) {
  Problem p{dtype, weight_dtype, k, std::move(slice_rows), {}, {}};
  const int slices = static_cast<int>(p.slice_rows.size());
  p.adapters.resize(ranks.size());
  p.table.resize(ranks.size());
  for (size_t s = 0; s < ranks.size(); ++s) {
    Adapter& ad = p.adapters[s];
    if (ranks[s] == 0) {
      ad.has_a = false;
      continue;
    }
    ad.rank = ranks[s];
    ad.a = random_values(static_cast<size_t>(slices) * ad.rank * k, weight_dtype, rng, 0.3f);
    ad.packed_a = pack(weight_dtype, ad.a, slices * ad.rank, k);
    p.table[s].a = ad.packed_a.data();
    p.table[s].rank = ad.rank;
    ad.b.resize(slices);
    ad.packed_b.resize(slices);
    for (int j = 0; j < slices; ++j) {
      if (untargeted == std::make_pair(static_cast<int>(s), j)) continue;
      ad.b[j] = random_values(static_cast<size_t>(p.slice_rows[j]) * ad.rank, weight_dtype, rng, 0.5f);
      ad.packed_b[j] = pack(weight_dtype, ad.b[j], p.slice_rows[j], ad.rank);
      p.table[s].b[j] = ad.packed_b[j].data();
    }
  }
  return p;
}

// Runs lora_add on `out` (row stride out_stride).
void run_into(const Problem& p, const Values& x, int64_t x_stride, const std::vector<int32_t>& slots, Values& out,
              int64_t out_stride, int threads) {
  vpage::LoraArgs a;
  a.out = out.data(p.dtype);
  a.x = x.data(p.dtype);
  a.m = static_cast<int64_t>(slots.size());
  a.k = p.k;
  a.x_stride = x_stride;
  a.out_stride = out_stride;
  a.token_slots = slots.data();
  a.slots = p.table.data();
  a.num_slots = static_cast<int32_t>(p.table.size());
  a.num_slices = static_cast<int32_t>(p.slice_rows.size());
  for (int j = 0; j < a.num_slices; ++j) a.slice_rows[j] = p.slice_rows[j];
  a.dtype = p.dtype;
  a.weight_dtype = p.weight_dtype;
  vpage::cpu::lora_add(a, threads);
}

// lora_add on a copy of `out`.
Values run(const Problem& p, const Values& x, int64_t x_stride, const std::vector<int32_t>& slots, const Values& out,
           int64_t out_stride, int threads) {
  Values result = out;
  run_into(p, x, x_stride, slots, result, out_stride, threads);
  return result;
}

bool same_bits(const Problem& p, const Values& a, size_t ai, const Values& b, size_t bi) {
  return p.dtype == DType::kFloat32 ? std::memcmp(&a.exact[ai], &b.exact[bi], sizeof(float)) == 0
                                    : a.half[ai] == b.half[bi];
}

void check_batch(const Problem& p, const std::vector<int32_t>& slots, std::mt19937& rng) {
  const int64_t m = static_cast<int64_t>(slots.size());
  const int k = p.k, n = p.n();
  const int64_t x_stride = k + 5, out_stride = n + 3;
  const Values x = random_values(static_cast<size_t>(m * x_stride), p.dtype, rng);
  const Values before = random_values(static_cast<size_t>(m * out_stride), p.dtype, rng, 4.0f);
  const Values after = run(p, x, x_stride, slots, before, out_stride, 2);
  const double eps = 1.2e-7, out_eps = p.dtype == DType::kFloat32 ? eps : 1.0 / 256;
  for (int64_t t = 0; t < m; ++t) {
    const int32_t s = slots[t];
    const bool active = s >= 0 && p.adapters[s].has_a;
    int32_t col0 = 0;
    for (size_t j = 0; j < p.slice_rows.size(); col0 += p.slice_rows[j++]) {
      const bool targeted = active && !p.adapters[s].b[j].exact.empty();
      for (int c = 0; c < p.slice_rows[j]; ++c) {
        const size_t i = static_cast<size_t>(t * out_stride + col0 + c);
        if (!targeted) {
          EXPECT_MSG(same_bits(p, after, i, before, i), "a row or slice without an adapter changed");
          continue;
        }
        // out += sum_r B[c, r] * (sum_u x[u] A[j * rank + r, u]); the float32 error grows with
        // the sums of absolute products.
        const Adapter& ad = p.adapters[s];
        double delta = 0.0, magnitude = 0.0;
        for (int r = 0; r < ad.rank; ++r) {
          double shrunk = 0.0, shrunk_abs = 0.0;
          for (int u = 0; u < k; ++u) {
            const double prod = static_cast<double>(x.at(p.dtype, t * x_stride + u)) *
                                ad.a.at(p.weight_dtype, (static_cast<size_t>(j) * ad.rank + r) * k + u);
            shrunk += prod;
            shrunk_abs += std::fabs(prod);
          }
          const double w = ad.b[j].at(p.weight_dtype, static_cast<size_t>(c) * ad.rank + r);
          delta += w * shrunk;
          magnitude += std::fabs(w) * shrunk_abs;
        }
        const double want = before.at(p.dtype, i) + delta;
        const double got = after.at(p.dtype, i);
        const double bound = (k + ad.rank + 4) * eps * magnitude + out_eps * std::fabs(want) + 1e-30;
        EXPECT_MSG(std::fabs(got - want) <= bound, "row " + std::to_string(t) + " slot " + std::to_string(s) +
                                                       " column " + std::to_string(col0 + c) + ": got " +
                                                       std::to_string(got) + ", want " + std::to_string(want));
      }
    }
    for (int c = n; c < out_stride; ++c) {
      const size_t i = static_cast<size_t>(t * out_stride + c);
      EXPECT_MSG(same_bits(p, after, i, before, i), "a column past n changed");
    }
  }
  for (int threads : {1, 3}) {
    const Values again = run(p, x, x_stride, slots, before, out_stride, threads);
    EXPECT(again.exact == after.exact && again.half == after.half);
  }
  // Batch invariance: the first and last rows alone give the same bits.
  for (int64_t t : {int64_t{0}, m - 1}) {
    Values x_row, out_row;
    x_row.exact.assign(x.exact.begin() + t * x_stride, x.exact.begin() + (t + 1) * x_stride);
    x_row.half.assign(x.half.begin() + t * x_stride, x.half.begin() + (t + 1) * x_stride);
    out_row.exact.assign(before.exact.begin() + t * out_stride, before.exact.begin() + (t + 1) * out_stride);
    out_row.half.assign(before.half.begin() + t * out_stride, before.half.begin() + (t + 1) * out_stride);
    const Values single = run(p, x_row, x_stride, {slots[t]}, out_row, out_stride, 2);
    for (int c = 0; c < n; ++c) {
      EXPECT_MSG(same_bits(p, single, c, after, static_cast<size_t>(t * out_stride + c)),
                 "row " + std::to_string(t) + " alone differs from its batch");
    }
  }
}

// m rows of random slots in [-1, num_slots), in no order.
std::vector<int32_t> random_slots(int64_t m, int num_slots, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> dist(-1, num_slots - 1);
  std::vector<int32_t> slots(static_cast<size_t>(m));
  for (int32_t& s : slots) s = dist(rng);
  return slots;
}

TEST_CASE("lora_add: float32 and bfloat16, mixed ranks, every ISA, awkward sizes") {
  vpage_test::AutoIsaOnExit restore;
  std::mt19937 rng(3);
  for (const std::string& isa : vpage_test::supported_isas()) {
    vpage::cpu::set_cpu_isa(isa);
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      for (DType weight_dtype : {DType::kFloat32, DType::kBFloat16}) {
        if (dtype == DType::kBFloat16 && weight_dtype == DType::kFloat32) continue;
        // qkv-like slices; slot 3 has no A, slot 1 leaves the k slice alone.
        const Problem qkv = make_problem(dtype, weight_dtype, 72, {96, 32, 32}, {8, 1, 16, 0}, {1, 1}, rng);
        check_batch(qkv, {2}, rng);
        check_batch(qkv, random_slots(300, 4, rng), rng);
        check_batch(qkv, {-1, 1, 0, 0, 2, -1, 1, 3, 2}, rng);
        // gate_up-like and single-slice projections, k over two of the kernel's k chunks.
        const Problem gate_up = make_problem(dtype, weight_dtype, 576, {45, 45}, {16, 8, 1}, {2, 0}, rng);
        check_batch(gate_up, random_slots(37, 3, rng), rng);
        const Problem down = make_problem(dtype, weight_dtype, 576, {72}, {1, 16}, {-1, -1}, rng);
        check_batch(down, random_slots(300, 2, rng), rng);
        check_batch(down, {1}, rng);
      }
    }
  }
}

TEST_CASE("lora_add: no adapter in the batch leaves out alone") {
  std::mt19937 rng(5);
  const Problem p = make_problem(DType::kFloat32, DType::kFloat32, 72, {40}, {4, 0}, {-1, -1}, rng);
  check_batch(p, {-1, 1, -1, 1}, rng);
  const Problem empty = make_problem(DType::kFloat32, DType::kFloat32, 72, {40}, {}, {-1, -1}, rng);
  check_batch(empty, {-1, -1}, rng);
}

TEST_CASE("lora_add: bad arguments throw and leave out unchanged") {
  std::mt19937 rng(9);
  const Problem p = make_problem(DType::kFloat32, DType::kFloat32, 72, {96, 32, 32}, {8, 4}, {-1, -1}, rng);
  const Values x = random_values(3 * 72, DType::kFloat32, rng);
  const Values out = random_values(3 * 160, DType::kFloat32, rng);
  for (int32_t bad : {2, -2}) {
    Values result = out;
    EXPECT_THROWS_WITH(run_into(p, x, 72, {0, bad, 1}, result, 160, 2), vpage::CheckError, "names slot");
    EXPECT(result.exact == out.exact);
  }
  Problem zero_rank = p;
  zero_rank.table[1].rank = 0;
  EXPECT_THROWS_WITH(run(zero_rank, x, 72, {0, 1, 1}, out, 160, 2), vpage::CheckError, "has rank 0");
  EXPECT_THROWS_WITH(run(p, x, 72, {0, 1, 1}, out, 150, 2), vpage::CheckError, "out_stride");
  EXPECT_THROWS_WITH(run(p, x, 71, {0, 1, 1}, out, 160, 2), vpage::CheckError, "bad sizes");
  Problem no_table = p;
  no_table.table.clear();
  EXPECT_THROWS_WITH(run(no_table, x, 72, {0, -1, -1}, out, 160, 2), vpage::CheckError, "names slot");
}

}  // namespace

TEST_MAIN()
