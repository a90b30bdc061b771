// CPU kernels against a float64 reference: random caches written with reshape_and_cache
// through shuffled block tables, poisoned (NaN) outputs and unused cache slots, decode and
// chunked prefill, every instruction set this CPU has (each decode row bitwise what its sequence
// gets alone); bit-exact copy/swap; bad arguments;
// the fused layer ops (RMSNorm with residual add, SiLU-and-multiply).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "cpu_isas.h"
#include "vpage/common.h"
#include "vpage/kernels/cpu_kernels.h"
#include "vpage/kernels/half.h"
#include "vpage/kernels/layer_ops.h"
#include "vpage/kernels/sampler_ops.h"

using namespace vpage_test;

namespace {

// Values stored in a byte buffer of the given dtype.
struct Buffer {
  vpage::DType dtype;
  std::vector<uint8_t> bytes;
  Buffer(vpage::DType d, size_t n, uint8_t fill = 0xff) : dtype(d), bytes(n * vpage::dtype_size(d), fill) {}
  void* data() { return bytes.data(); }
  double get(size_t i) const {
    if (dtype == vpage::DType::kFloat32) {
      float f;
      std::memcpy(&f, bytes.data() + 4 * i, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, bytes.data() + 2 * i, 2);
    return dtype == vpage::DType::kFloat16 ? vpage::half_to_float(h) : vpage::bfloat16_to_float(h);
  }
  void set(size_t i, float f) {
    if (dtype == vpage::DType::kFloat32) {
      std::memcpy(bytes.data() + 4 * i, &f, 4);
      return;
    }
    const uint16_t h = dtype == vpage::DType::kFloat16 ? vpage::float_to_half(f) : vpage::float_to_bfloat16(f);
    std::memcpy(bytes.data() + 2 * i, &h, 2);
  }
};

struct AttentionCase {
  vpage::DType dtype;
  int num_heads, num_kv_heads, head_size, block_size;
  std::vector<int> context_lens;
  std::vector<int> query_lens;  // empty: decode
  bool float_io = false;        // float32 key/value/query/out with a 16-bit cache
};

// f rounded to dtype, as a cache of that dtype stores it.
double stored(vpage::DType dtype, float f) {
  Buffer one(dtype, 1);
  one.set(0, f);
  return one.get(0);
}

void run_case(const AttentionCase& c, std::mt19937& rng, const std::string& isa) {
  const int num_seqs = static_cast<int>(c.context_lens.size());
  const bool decode = c.query_lens.empty();
  const int hs = c.head_size, bs = c.block_size, nkv = c.num_kv_heads;
  const vpage::DType io = c.float_io ? vpage::DType::kFloat32 : c.dtype;
  int max_blocks = 0, total_blocks = 0, max_len = 0;
  for (int len : c.context_lens) {
    max_blocks = std::max(max_blocks, (len + bs - 1) / bs);
    total_blocks += (len + bs - 1) / bs;
    max_len = std::max(max_len, len);
  }
  const int num_blocks = total_blocks + 3;
  std::vector<int32_t> physical(num_blocks);
  for (int i = 0; i < num_blocks; ++i) physical[i] = i;
  std::shuffle(physical.begin(), physical.end(), rng);
  std::vector<int32_t> tables(static_cast<size_t>(num_seqs) * max_blocks, -1);
  int next = 0;
  for (int s = 0; s < num_seqs; ++s) {
    for (int b = 0; b < (c.context_lens[s] + bs - 1) / bs; ++b) tables[s * max_blocks + b] = physical[next++];
  }
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const size_t cache_elems = static_cast<size_t>(num_blocks) * nkv * hs * bs;
  Buffer key_cache(c.dtype, cache_elems), value_cache(c.dtype, cache_elems);  // 0xff.. = NaN
  std::vector<std::vector<double>> keys(num_seqs), values(num_seqs);  // [len][nkv][hs]
  for (int s = 0; s < num_seqs; ++s) {
    const int len = c.context_lens[s];
    Buffer k(io, static_cast<size_t>(len) * nkv * hs), v(io, static_cast<size_t>(len) * nkv * hs);
    std::vector<int64_t> slots(len);
    for (size_t i = 0; i < static_cast<size_t>(len) * nkv * hs; ++i) {
      k.set(i, dist(rng));
      v.set(i, dist(rng));
      keys[s].push_back(stored(c.dtype, static_cast<float>(k.get(i))));
      values[s].push_back(stored(c.dtype, static_cast<float>(v.get(i))));
    }
    for (int t = 0; t < len; ++t) slots[t] = static_cast<int64_t>(tables[s * max_blocks + t / bs]) * bs + t % bs;
    vpage::ReshapeAndCacheArgs r;
    r.key = k.data();
    r.value = v.data();
    r.key_cache = key_cache.data();
    r.value_cache = value_cache.data();
    r.slot_mapping = slots.data();
    r.num_tokens = len;
    r.key_stride = r.value_stride = static_cast<int64_t>(nkv) * hs;
    r.dtype = io;
    r.cache = {num_blocks, nkv, hs, bs, c.dtype};
    vpage::cpu::reshape_and_cache(r, 2);
  }
  std::vector<int32_t> query_start(num_seqs + 1, 0);
  for (int s = 0; s < num_seqs; ++s) query_start[s + 1] = query_start[s] + (decode ? 1 : c.query_lens[s]);
  const int num_tokens = query_start[num_seqs];
  Buffer query(io, static_cast<size_t>(num_tokens) * c.num_heads * hs);
  for (size_t i = 0; i < static_cast<size_t>(num_tokens) * c.num_heads * hs; ++i) query.set(i, dist(rng));
  Buffer out(io, static_cast<size_t>(num_tokens) * c.num_heads * hs);

  vpage::PagedAttentionArgs a;
  a.out = out.data();
  a.query = query.data();
  a.key_cache = key_cache.data();
  a.value_cache = value_cache.data();
  a.block_tables = tables.data();
  a.context_lens = c.context_lens.data();
  a.query_start_loc = decode ? nullptr : query_start.data();
  a.num_seqs = num_seqs;
  a.num_query_tokens = num_tokens;
  a.num_heads = c.num_heads;
  a.max_blocks_per_seq = max_blocks;
  a.max_context_len = max_len;
  a.query_stride = static_cast<int64_t>(c.num_heads) * hs;
  a.scale = 1.0f / std::sqrt(static_cast<float>(hs));
  a.dtype = io;
  a.cache = {num_blocks, nkv, hs, bs, c.dtype};
  vpage::cpu::paged_attention(a, 2);

  // float32 io: the reference uses the cache's rounded K/V, so only float32 rounding remains.
  const double tol = io == vpage::DType::kFloat32 ? 1e-4 : c.dtype == vpage::DType::kFloat16 ? 4e-3 : 2e-2;
  double worst = 0.0;
  const int group = c.num_heads / nkv;
  for (int s = 0; s < num_seqs; ++s) {
    const int len = c.context_lens[s];
    const int queries = query_start[s + 1] - query_start[s];
    for (int q = 0; q < queries; ++q) {
      const int visible = len - queries + q + 1;
      for (int h = 0; h < c.num_heads; ++h) {
        const int kv = h / group;
        const size_t row = (static_cast<size_t>(query_start[s] + q) * c.num_heads + h) * hs;
        std::vector<double> logits(visible);
        double m = -INFINITY;
        for (int t = 0; t < visible; ++t) {
          double dot = 0.0;
          for (int d = 0; d < hs; ++d) dot += query.get(row + d) * keys[s][(static_cast<size_t>(t) * nkv + kv) * hs + d];
          logits[t] = dot * a.scale;
          m = std::max(m, logits[t]);
        }
        double sum = 0.0;
        for (double& l : logits) sum += (l = std::exp(l - m));
        for (int d = 0; d < hs; ++d) {
          double o = 0.0;
          for (int t = 0; t < visible; ++t) o += logits[t] * values[s][(static_cast<size_t>(t) * nkv + kv) * hs + d];
          const double err = std::fabs(out.get(row + d) - o / sum);
          worst = std::isnan(err) ? INFINITY : std::max(worst, err);
        }
      }
    }
  }
  char what[256];
  std::snprintf(what, sizeof(what),
                "%s %s dtype=%d%s heads=%d/%d hs=%d bs=%d seqs=%d max_len=%d: max error %.3g (tol %.1g)", isa.c_str(),
                decode ? "decode" : "prefill", static_cast<int>(c.dtype), c.float_io ? " (float32 io)" : "", c.num_heads,
                nkv, hs, bs, num_seqs, max_len, worst, tol);
  EXPECT_MSG(worst <= tol, what);

  // Decode: each sequence alone gives the bits it got in the batch (batch invariance).
  if (!decode) return;
  const size_t row_bytes = static_cast<size_t>(c.num_heads) * hs * vpage::dtype_size(io);
  bool same = true;
  for (int s = 0; s < num_seqs; ++s) {
    Buffer alone(io, static_cast<size_t>(c.num_heads) * hs);
    vpage::PagedAttentionArgs one = a;
    one.out = alone.data();
    one.query = static_cast<const uint8_t*>(a.query) + s * row_bytes;
    one.block_tables = tables.data() + static_cast<size_t>(s) * max_blocks;
    one.context_lens = c.context_lens.data() + s;
    one.num_seqs = one.num_query_tokens = 1;
    vpage::cpu::paged_attention(one, 2);
    same = same && std::memcmp(alone.bytes.data(), out.bytes.data() + s * row_bytes, row_bytes) == 0;
  }
  EXPECT_MSG(same, std::string(what) + ": a sequence alone differs from its row in the batch");
}

}  // namespace

TEST_CASE("paged_attention: decode and chunked prefill against float64 in every instruction set") {
  const AutoIsaOnExit restore_isa;
  std::mt19937 rng(1234);
  const std::vector<AttentionCase> cases = {
      {vpage::DType::kFloat32, 4, 4, 64, 16, {1, 17, 54}, {}},
      {vpage::DType::kFloat32, 9, 3, 64, 8, {97, 1030}, {}},
      {vpage::DType::kFloat16, 8, 1, 128, 32, {33, 300}, {}},
      {vpage::DType::kBFloat16, 6, 2, 80, 16, {5, 1200}, {}},
      {vpage::DType::kFloat32, 9, 3, 64, 16, {17, 60}, {17, 7}},
      {vpage::DType::kBFloat16, 8, 1, 96, 8, {40}, {40}},
      {vpage::DType::kFloat16, 4, 2, 256, 12, {30, 19}, {3, 19}},
      // Decode at block boundaries, GQA groups 1/3/8 (1 or 3 rows per pass, 2 passes of 4).
      {vpage::DType::kFloat32, 3, 3, 64, 16, {1, 15, 16, 17, 1000}, {}},
      {vpage::DType::kBFloat16, 9, 3, 64, 32, {1, 15, 16, 17, 1000}, {}},
      {vpage::DType::kFloat16, 16, 2, 128, 8, {1, 15, 16, 17, 1000}, {}},
      // One long sequence: context partitions (tasks starting mid-context), groups 5 and 12.
      {vpage::DType::kFloat32, 5, 1, 64, 16, {2000}, {}},
      {vpage::DType::kBFloat16, 12, 1, 64, 32, {700}, {}},
      {vpage::DType::kFloat32, 4, 2, 256, 16, {63, 64, 65}, {}},
      // float32 activations with a 16-bit cache: decode (fast and old paths, partitions), prefill.
      {vpage::DType::kFloat16, 9, 3, 64, 16, {1, 17, 300, 2000}, {}, true},
      {vpage::DType::kBFloat16, 8, 2, 64, 12, {40, 5}, {}, true},
      {vpage::DType::kFloat16, 9, 3, 64, 16, {17, 60}, {17, 7}, true},
      {vpage::DType::kBFloat16, 4, 1, 128, 32, {33, 70}, {33, 1}, true},
      // Batches of 8 and more sequences (fast path: block 16 or 32; the general kernel: block
      // 12), context partitions, groups of 3 and 8.
      {vpage::DType::kBFloat16, 9, 3, 64, 16, {1, 16, 17, 40, 63, 64, 65, 300, 600, 1100}, {}},
      {vpage::DType::kFloat32, 16, 2, 64, 32, {5, 31, 33, 90, 129, 513, 700, 20, 9}, {}},
      {vpage::DType::kFloat16, 6, 3, 64, 12, {2, 13, 24, 25, 100, 530, 7, 61}, {}, true},
      // bfloat16 over a bfloat16 cache in blocks of 4 and 8 vectors (with AVX512-BF16: QK by bf16
      // dot products, 16-token tiles), head sizes 128 and 256.
      {vpage::DType::kBFloat16, 8, 2, 128, 64, {1, 63, 64, 65, 500}, {}},
      {vpage::DType::kBFloat16, 4, 1, 256, 128, {129, 700}, {}},
  };
  for (const std::string& isa : supported_isas()) {
    vpage::cpu::set_cpu_isa(isa);
    for (const AttentionCase& c : cases) run_case(c, rng, isa);
  }
}

TEST_CASE("copy_blocks and swap_blocks are bit-exact; swap_blocks rejects a block id out of range") {
  std::mt19937 rng(99);
  const vpage::CacheShape shape{6, 2, 64, 16, vpage::DType::kBFloat16};
  const size_t block_bytes = 2 * 64 * 16 * 2;
  std::vector<uint8_t> a(6 * block_bytes), b(6 * block_bytes), original;
  for (uint8_t& byte : a) byte = static_cast<uint8_t>(rng());
  for (uint8_t& byte : b) byte = static_cast<uint8_t>(rng());
  original = a;
  const int64_t mapping[] = {0, 3, 5, 1};
  void* keys[] = {a.data()};
  void* values[] = {b.data()};
  const std::vector<uint8_t> b_before = b;
  vpage::CopyBlocksArgs copy{keys, values, 1, mapping, 2, shape};
  vpage::cpu::copy_blocks(copy, 2);
  EXPECT_MSG(std::memcmp(a.data() + 3 * block_bytes, original.data(), block_bytes) == 0, "copy_blocks key 0->3");
  EXPECT_MSG(std::memcmp(b.data() + 1 * block_bytes, b_before.data() + 5 * block_bytes, block_bytes) == 0,
             "copy_blocks value 5->1");
  std::vector<uint8_t> pool(4 * block_bytes, 0);
  vpage::SwapBlocksArgs out{a.data(), pool.data(), static_cast<int64_t>(block_bytes), mapping, 2, 6, 4};
  const int64_t bad[] = {0, 4};
  vpage::SwapBlocksArgs wrong = out;
  wrong.block_mapping = bad;
  wrong.num_pairs = 1;
  EXPECT_THROWS_WITH(vpage::cpu::swap_blocks(wrong, 2), vpage::CheckError, "out of range");
  out.num_pairs = 1;
  vpage::cpu::swap_blocks(out, 2);
  EXPECT_MSG(std::memcmp(pool.data() + 3 * block_bytes, a.data(), block_bytes) == 0, "swap_blocks 0->3");
}

TEST_CASE("paged_attention and reshape_and_cache reject bad heads and dtype pairs") {
  vpage::PagedAttentionArgs a;
  a.num_heads = 3;
  a.cache = {4, 2, 64, 16, vpage::DType::kFloat32};
  a.query_stride = 192;
  EXPECT_THROWS_WITH(vpage::cpu::paged_attention(a, 1), vpage::CheckError, "multiple of num_kv_heads");

  // Activations meet a cache of their own dtype, or float32 a 16-bit one; nothing else.
  a.num_heads = 4;
  a.dtype = vpage::DType::kBFloat16;
  a.cache.dtype = vpage::DType::kFloat16;  // a bfloat16 query with a float16 cache
  EXPECT_THROWS_WITH(vpage::cpu::paged_attention(a, 1), vpage::CheckError, "dtype");
  a.dtype = vpage::DType::kFloat16;
  a.cache.dtype = vpage::DType::kFloat32;  // a float16 query with a float32 cache
  EXPECT_THROWS_WITH(vpage::cpu::paged_attention(a, 1), vpage::CheckError, "dtype");
  vpage::ReshapeAndCacheArgs r;
  r.dtype = vpage::DType::kFloat16;
  r.cache = {4, 2, 64, 16, vpage::DType::kFloat32};  // float16 rows into a float32 cache
  EXPECT_THROWS_WITH(vpage::cpu::reshape_and_cache(r, 1), vpage::CheckError, "dtype");
}

TEST_CASE("logsumexp_argmax against double: vocab sizes around the vector widths, -inf entries, ties") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-20.0f, 20.0f);
  const int64_t rows = 5;
  for (const int64_t vocab : {1, 15, 16, 17, 513, 1000}) {
    const int64_t stride = vocab + 3;
    std::vector<float> logits(rows * stride);
    for (float& v : logits) v = dist(rng);
    for (int64_t i = 1; i < vocab; i += 4) logits[stride + i] = -INFINITY;  // row 1: -inf entries
    for (int64_t i = 0; i < vocab; ++i) logits[2 * stride + i] = static_cast<float>(i % 3);  // row 2: ties
    std::vector<float> log_norm(rows, NAN);
    std::vector<int64_t> argmax(rows, -1);
    vpage::LogsumexpArgmaxArgs a;
    a.logits = logits.data();
    a.num_rows = rows;
    a.vocab = vocab;
    a.row_stride = stride;
    a.log_norm = log_norm.data();
    a.argmax = argmax.data();
    vpage::cpu::logsumexp_argmax(a, 2);
    for (int64_t r = 0; r < rows; ++r) {
      const float* x = logits.data() + r * stride;
      int64_t best = 0;
      for (int64_t i = 1; i < vocab; ++i) best = x[i] > x[best] ? i : best;
      double sum = 0;
      for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(x[i]) - x[best]);
      const double ref = x[best] + std::log(sum);
      const std::string where = "logsumexp_argmax vocab " + std::to_string(vocab) + " row " + std::to_string(r);
      EXPECT_MSG(argmax[r] == best, where + ": argmax " + std::to_string(argmax[r]) + " != " + std::to_string(best));
      EXPECT_MSG(std::fabs(log_norm[r] - ref) <= 1e-6 * std::max(1.0, std::fabs(ref)), where + ": log_norm");
    }
  }
}

// float32 RMSNorm (with residual) and SiLU-and-multiply against double, odd sizes (vector
// remainders), 2 threads, NaN-poisoned outputs.
TEST_CASE("rms_norm with residual and silu_and_mul against double") {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  const int64_t tokens = 19;
  for (const int32_t hidden : {1, 23, 576}) {
    std::vector<float> x(tokens * hidden), residual(x.size()), weight(hidden), out(x.size(), NAN);
    for (float& v : x) v = dist(rng);
    for (float& v : residual) v = dist(rng);
    for (float& v : weight) v = dist(rng);
    const std::vector<float> residual_before = residual;
    vpage::RmsNormArgs a;
    a.out = out.data();
    a.x = x.data();
    a.residual = residual.data();
    a.weight = weight.data();
    a.num_tokens = tokens;
    a.hidden_size = hidden;
    a.eps = 1e-5f;
    vpage::cpu::rms_norm(a, 2);
    double worst = 0;
    bool residual_ok = true;
    for (int64_t t = 0; t < tokens; ++t) {
      double sum = 0;
      for (int32_t i = 0; i < hidden; ++i) {
        const float r = residual_before[t * hidden + i] + x[t * hidden + i];
        residual_ok = residual_ok && residual[t * hidden + i] == r;
        sum += static_cast<double>(r) * r;
      }
      const double inv = 1.0 / std::sqrt(sum / hidden + 1e-5);
      for (int32_t i = 0; i < hidden; ++i) {
        const double ref = residual[t * hidden + i] * inv * weight[i];
        worst = std::max(worst, std::fabs(out[t * hidden + i] - ref) / (std::fabs(ref) + 1e-6));
      }
    }
    EXPECT_MSG(residual_ok, "rms_norm: residual += x, hidden " + std::to_string(hidden));
    EXPECT_MSG(worst < 2e-6, "rms_norm vs double, hidden " + std::to_string(hidden) + ": " + std::to_string(worst));

    const int32_t d = hidden;
    std::vector<float> gate_up(tokens * 2 * d), act(tokens * d, NAN);
    for (float& v : gate_up) v = 3.0f * dist(rng);
    vpage::SiluAndMulArgs s;
    s.out = act.data();
    s.x = gate_up.data();
    s.num_tokens = tokens;
    s.d = d;
    vpage::cpu::silu_and_mul(s, 2);
    worst = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int32_t i = 0; i < d; ++i) {
        const double g = gate_up[t * 2 * d + i], u = gate_up[t * 2 * d + d + i];
        const double ref = g / (1.0 + std::exp(-g)) * u;
        worst = std::max(worst, std::fabs(act[t * d + i] - ref) / (std::fabs(ref) + 1e-30));
      }
    }
    EXPECT_MSG(worst < 2e-6, "silu_and_mul vs double, d " + std::to_string(d) + ": " + std::to_string(worst));
  }
}

// This test binary loads no OpenMP runtime: "openmp" falls back to the own pool (the kernels
// then still run, see the fork case); an unknown source is rejected.
TEST_CASE("set_thread_source: openmp falls back to the own pool here; unknown sources throw") {
  EXPECT(vpage::cpu::set_thread_source("openmp").empty());
  EXPECT_THROWS_WITH(vpage::cpu::set_thread_source("tbb"), vpage::CheckError, "expected 'own' or 'openmp'");
  EXPECT(vpage::cpu::set_thread_source("own").empty());
}

// The thread pool survives fork(): a child whose parent already ran a multi-threaded kernel
// (so the pool has workers, which do not exist in the child) runs one too. Without the
// atfork handler the child waits forever for the missing workers; alarm() turns that into
// a failure instead of a hung test.
TEST_CASE("the thread pool survives fork(): a child runs multi-threaded kernels") {
  const int num_seqs = 8, heads = 2, hs = 16, bs = 16, context = 40, blocks_per_seq = 3;
  const int64_t num_blocks = static_cast<int64_t>(num_seqs) * blocks_per_seq;
  // Zero keys: uniform attention, so every output equals the (constant) value 2.
  std::vector<float> key_cache(num_blocks * hs * bs, 0.0f), value_cache(num_blocks * hs * bs, 2.0f);
  std::vector<int32_t> tables(num_blocks), lens(num_seqs, context);
  for (int64_t i = 0; i < num_blocks; ++i) tables[i] = static_cast<int32_t>(num_blocks - 1 - i);
  std::vector<float> query(static_cast<size_t>(num_seqs) * heads * hs, 1.0f), out(query.size());
  vpage::PagedAttentionArgs a;
  a.out = out.data();
  a.query = query.data();
  a.key_cache = key_cache.data();
  a.value_cache = value_cache.data();
  a.block_tables = tables.data();
  a.context_lens = lens.data();
  a.num_seqs = num_seqs;
  a.num_query_tokens = num_seqs;
  a.num_heads = heads;
  a.max_blocks_per_seq = blocks_per_seq;
  a.max_context_len = context;
  a.query_stride = heads * hs;
  a.scale = 0.25f;
  a.cache = {num_blocks, 1, hs, bs, vpage::DType::kFloat32};
  const auto all_two = [&] {
    return std::all_of(out.begin(), out.end(), [](float v) { return std::fabs(v - 2.0f) < 1e-5f; });
  };
  vpage::cpu::paged_attention(a, 2);
  EXPECT_MSG(all_two(), "parent result before fork");
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(20);
    std::fill(out.begin(), out.end(), 0.0f);
    vpage::cpu::paged_attention(a, 2);
    vpage::cpu::paged_attention(a, 2);
    _exit(all_two() ? 0 : 1);
  }
  EXPECT_MSG(pid > 0, "fork() failed");
  int status = 0;
  EXPECT(waitpid(pid, &status, 0) == pid);
  EXPECT_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0,
             "multi-threaded paged_attention in a forked child (status " + std::to_string(status) + ")");
  std::fill(out.begin(), out.end(), 0.0f);
  vpage::cpu::paged_attention(a, 2);
  EXPECT_MSG(all_two(), "parent result after fork");
}

TEST_MAIN()
