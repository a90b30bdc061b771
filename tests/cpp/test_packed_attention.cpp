// packed_attention against a float64 reference: random strided Q/K/V rows (views of one fused
// QKV buffer), poisoned (NaN) outputs, awkward lengths around the SIMD widths and the K/V tile,
// queries that are all of a sequence or only some of its rows, windows, every instruction set
// this CPU has; a sequence alone gives the bits it got in the batch; bad arguments throw.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "cpu_isas.h"
#include "vpage/common.h"
#include "vpage/kernels/cpu_kernels.h"
#include "vpage/kernels/half.h"

using namespace vpage_test;

namespace {

float round_to(vpage::DType dtype, float f) {
  if (dtype == vpage::DType::kFloat16) return vpage::half_to_float(vpage::float_to_half(f));
  if (dtype == vpage::DType::kBFloat16) return vpage::bfloat16_to_float(vpage::float_to_bfloat16(f));
  return f;
}

// Rows of `width` elements, `stride` apart, in a dtype; read back as double.
struct Rows {
  vpage::DType dtype;
  int64_t stride;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  Rows(vpage::DType d, int64_t rows, int64_t stride_) : dtype(d), stride(stride_) {
    if (d == vpage::DType::kFloat32) {
      f32.assign(rows * stride, NAN);
    } else {
      u16.assign(rows * stride, 0x7fc1);  // NaN in both 16-bit formats
    }
  }
  void* data() { return dtype == vpage::DType::kFloat32 ? static_cast<void*>(f32.data()) : u16.data(); }
  double get(int64_t row, int64_t col) const {
    const int64_t i = row * stride + col;
    if (dtype == vpage::DType::kFloat32) return f32[i];
    return dtype == vpage::DType::kFloat16 ? vpage::half_to_float(u16[i]) : vpage::bfloat16_to_float(u16[i]);
  }
  void set(int64_t row, int64_t col, float v) {
    const int64_t i = row * stride + col;
    if (dtype == vpage::DType::kFloat32) {
      f32[i] = v;
    } else {
      u16[i] = dtype == vpage::DType::kFloat16 ? vpage::float_to_half(v) : vpage::float_to_bfloat16(v);
    }
  }
};

struct PackedCase {
  vpage::DType dtype;
  int num_heads, head_size;
  std::vector<int> lens;
  bool all_queries;  // else 1-3 query rows per sequence at random positions
  int window;
};

void run_case(const PackedCase& c, std::mt19937& rng, const std::string& isa) {
  const int hs = c.head_size, width = c.num_heads * hs, n = static_cast<int>(c.lens.size());
  int64_t kv_rows = 0;
  std::vector<int32_t> kv_starts, q_starts, q_lens, q_offsets;
  int64_t q_rows = 0;
  std::uniform_int_distribution<int> pick(0, 1 << 20);
  for (int s = 0; s < n; ++s) {
    kv_starts.push_back(static_cast<int32_t>(kv_rows));
    kv_rows += c.lens[s];
    const int queries = c.all_queries || c.lens[s] == 0 ? c.lens[s] : 1 + pick(rng) % std::min(3, c.lens[s]);
    q_starts.push_back(static_cast<int32_t>(q_rows));
    q_lens.push_back(queries);
    q_offsets.push_back(queries == c.lens[s] ? 0 : pick(rng) % (c.lens[s] - queries + 1));
    q_rows += queries;
  }
  // K and V are views of one fused QKV buffer (row stride 3 * width), the queries another one
  // (stride width + 16), the output a third (stride width + 32).
  Rows qkv(c.dtype, kv_rows, 3 * width), query(c.dtype, q_rows, width + 16), out(c.dtype, q_rows, width + 32);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t r = 0; r < kv_rows; ++r) {
    for (int col = 0; col < 3 * width; ++col) qkv.set(r, col, normal(rng));
  }
  for (int64_t r = 0; r < q_rows; ++r) {
    for (int col = 0; col < width; ++col) query.set(r, col, 2.0f * normal(rng));
  }
  vpage::PackedAttentionArgs a;
  a.out = out.data();
  a.query = query.data();
  const size_t elem = vpage::dtype_size(c.dtype);
  a.key = static_cast<const uint8_t*>(qkv.data()) + width * elem;
  a.value = static_cast<const uint8_t*>(qkv.data()) + 2 * width * elem;
  a.kv_starts = kv_starts.data();
  a.kv_lens = c.lens.data();
  a.q_starts = q_starts.data();
  a.q_lens = q_lens.data();
  a.q_offsets = q_offsets.data();
  a.num_seqs = n;
  a.num_query_rows = q_rows;
  a.num_kv_rows = kv_rows;
  a.num_heads = c.num_heads;
  a.head_size = hs;
  a.query_stride = width + 16;
  a.key_stride = a.value_stride = 3 * width;
  a.out_stride = width + 32;
  a.scale = 1.0f / std::sqrt(static_cast<float>(hs));
  a.window = c.window;
  a.dtype = c.dtype;
  vpage::cpu::packed_attention(a, 2);

  double worst = 0.0;
  bool padding_kept = true;
  for (int s = 0; s < n; ++s) {
    for (int q = 0; q < q_lens[s]; ++q) {
      const int pos = q_offsets[s] + q;
      const int lo = c.window > 0 ? std::max(0, pos - c.window) : 0;
      const int hi = c.window > 0 ? std::min(c.lens[s], pos + c.window + 1) : c.lens[s];
      const int64_t qr = q_starts[s] + q;
      for (int h = 0; h < c.num_heads; ++h) {
        std::vector<double> p(hi - lo);
        double m = -INFINITY;
        for (int t = lo; t < hi; ++t) {
          double dot = 0.0;
          for (int d = 0; d < hs; ++d) dot += query.get(qr, h * hs + d) * qkv.get(kv_starts[s] + t, width + h * hs + d);
          p[t - lo] = dot * a.scale;
          m = std::max(m, p[t - lo]);
        }
        double sum = 0.0;
        for (double& v : p) sum += (v = std::exp(v - m));
        for (int d = 0; d < hs; ++d) {
          double o = 0.0;
          for (int t = lo; t < hi; ++t) o += p[t - lo] * qkv.get(kv_starts[s] + t, 2 * width + h * hs + d);
          const double err = std::fabs(out.get(qr, h * hs + d) - o / sum);
          worst = std::isnan(err) ? INFINITY : std::max(worst, err);
        }
      }
      for (int col = width; col < width + 32; ++col) padding_kept = padding_kept && std::isnan(out.get(qr, col));
    }
  }
  const double tol = c.dtype == vpage::DType::kFloat32 ? 2e-5 : c.dtype == vpage::DType::kFloat16 ? 4e-3 : 3e-2;
  char what[200];
  std::snprintf(what, sizeof(what), "%s dtype=%d heads=%d hs=%d seqs=%d window=%d %s: max error %.3g (tol %.1g)",
                isa.c_str(), static_cast<int>(c.dtype), c.num_heads, hs, n, c.window,
                c.all_queries ? "all rows" : "some rows", worst, tol);
  EXPECT_MSG(worst <= tol, what);
  EXPECT_MSG(padding_kept, std::string(what) + ": wrote past num_heads * head_size");

  // Each sequence alone: the same bits as in the batch.
  bool same = true;
  for (int s = 0; s < n; ++s) {
    Rows alone(c.dtype, std::max(q_lens[s], 1), width + 32);
    vpage::PackedAttentionArgs one = a;
    one.out = alone.data();
    one.query = static_cast<const uint8_t*>(query.data()) + q_starts[s] * query.stride * elem;
    one.key = static_cast<const uint8_t*>(a.key) + kv_starts[s] * qkv.stride * elem;
    one.value = static_cast<const uint8_t*>(a.value) + kv_starts[s] * qkv.stride * elem;
    const int32_t zero = 0;
    one.kv_starts = one.q_starts = &zero;
    one.kv_lens = &c.lens[s];
    one.q_lens = &q_lens[s];
    one.q_offsets = &q_offsets[s];
    one.num_seqs = 1;
    one.num_query_rows = q_lens[s];
    one.num_kv_rows = c.lens[s];
    vpage::cpu::packed_attention(one, 1);
    for (int q = 0; q < q_lens[s]; ++q) {
      for (int col = 0; col < width; ++col) {
        const double x = alone.get(q, col), y = out.get(q_starts[s] + q, col);
        same = same && (x == y || (std::isnan(x) && std::isnan(y)));
      }
    }
  }
  EXPECT_MSG(same, std::string(what) + ": a sequence alone differs from its rows in the batch");
}

}  // namespace

TEST_CASE("packed_attention against float64 in every instruction set: lengths, query rows, windows") {
  const AutoIsaOnExit restore_isa;
  std::mt19937 rng(4321);
  using vpage::DType;
  const std::vector<PackedCase> cases = {
      {DType::kFloat32, 4, 32, {1, 2, 15, 16, 17, 31, 32, 33, 100}, true, 0},
      {DType::kFloat32, 3, 64, {47, 48, 49, 200, 0, 5}, true, 0},
      {DType::kBFloat16, 6, 32, {7, 64, 65, 130}, true, 0},
      {DType::kFloat16, 2, 80, {33, 190}, true, 0},
      {DType::kFloat32, 4, 32, {3, 50, 257}, false, 0},
      {DType::kBFloat16, 2, 128, {1, 40, 300}, false, 0},
      // Windows: shorter than, near and longer than a sequence; with a few query rows.
      {DType::kFloat32, 2, 32, {10, 70, 200}, true, 16},
      {DType::kBFloat16, 3, 64, {33, 129}, true, 40},
      {DType::kFloat32, 2, 32, {90, 300}, false, 7},
      {DType::kFloat16, 2, 48, {64, 65}, true, 100},
  };
  for (const std::string& isa : supported_isas()) {
    vpage::cpu::set_cpu_isa(isa);
    for (const PackedCase& c : cases) run_case(c, rng, isa);
  }
}

TEST_CASE("packed_attention rejects rows out of range, queries past a sequence and bad shapes") {
  std::vector<float> buf(64 * 64, 1.0f), out(64 * 64);
  const int32_t kv_starts[] = {0}, lens[] = {10}, q_starts[] = {0}, q_lens[] = {4};
  int32_t offsets[] = {0};
  vpage::PackedAttentionArgs a;
  a.out = out.data();
  a.query = a.key = a.value = buf.data();
  a.kv_starts = kv_starts;
  a.kv_lens = lens;
  a.q_starts = q_starts;
  a.q_lens = q_lens;
  a.q_offsets = offsets;
  a.num_seqs = 1;
  a.num_query_rows = 4;
  a.num_kv_rows = 10;
  a.num_heads = 2;
  a.head_size = 32;
  a.query_stride = a.key_stride = a.value_stride = a.out_stride = 64;
  vpage::cpu::packed_attention(a, 2);
  EXPECT(std::fabs(out[0] - 1.0f) < 1e-6f);  // equal values: the mean is the value

  using vpage::CheckError;
  vpage::PackedAttentionArgs bad = a;
  bad.num_kv_rows = 9;
  EXPECT_THROWS_WITH(vpage::cpu::packed_attention(bad, 2), CheckError, "key rows [0, 10) of sequence 0");
  bad = a;
  bad.num_query_rows = 3;
  EXPECT_THROWS_WITH(vpage::cpu::packed_attention(bad, 2), CheckError, "query rows [0, 4)");
  offsets[0] = 7;  // queries at positions 7..10 of a 10-token sequence
  EXPECT_THROWS_WITH(vpage::cpu::packed_attention(a, 2), CheckError, "positions [7, 11)");
  offsets[0] = 0;
  bad = a;
  bad.head_size = 24;
  EXPECT_THROWS_WITH(vpage::cpu::packed_attention(bad, 2), CheckError, "multiple of 16");
  bad = a;
  bad.query_stride = 63;
  EXPECT_THROWS_WITH(vpage::cpu::packed_attention(bad, 2), CheckError, "row strides");
  bad = a;
  bad.window = -1;
  EXPECT_THROWS_WITH(vpage::cpu::packed_attention(bad, 2), CheckError, "window must be >= 0");
}

TEST_MAIN()
