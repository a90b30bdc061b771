// The token-bitmask kernels against plain loops: apply_token_bitmask and logsumexp_argmax
// with a bitmask (argmax over the allowed tokens, log-normaliser of the whole row in double).
// Vocab sizes around the word and vector widths, strided rows and wider bitmask rows with
// stray bits past the vocabulary, rows allowing every token, none or one, NaN/inf entries,
// 1 and 3 threads, NaN-poisoned outputs and padding that must stay untouched; bad sizes throw.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "check.h"
#include "vpage/common.h"
#include "vpage/kernels/sampler_ops.h"
#include "vpage/kernels/token_bitmask.h"

using namespace vpage_test;

namespace {

constexpr float kPad = 1234.5f;

struct Rows {
  int64_t rows, vocab, row_stride, bitmask_stride;
  std::vector<float> logits;     // [rows, row_stride], padding kPad
  std::vector<int32_t> bitmask;  // [rows, bitmask_stride]
};

bool allowed(const Rows& c, int64_t r, int64_t t) {
  return (static_cast<uint32_t>(c.bitmask[r * c.bitmask_stride + t / 32]) >> (t % 32)) & 1u;
}

// Random logits and words; row 0 allows every token, row 1 none, row 2 one token, row 3 holds
// NaN and inf entries; every word past the vocabulary (and bits past it) random.
Rows make_case(int64_t rows, int64_t vocab, int64_t pad, int64_t extra_words, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.5f, 4.0f);
  Rows c{rows, vocab, vocab + pad, vpage::token_bitmask_words(vocab) + extra_words, {}, {}};
  c.logits.assign(rows * c.row_stride, kPad);
  c.bitmask.resize(rows * c.bitmask_stride);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < vocab; ++t) c.logits[r * c.row_stride + t] = normal(rng);
  }
  for (int32_t& w : c.bitmask) w = static_cast<int32_t>(rng());
  const int64_t words = vpage::token_bitmask_words(vocab);
  for (int64_t w = 0; w < words; ++w) {
    const uint32_t tail = w == words - 1 && vocab % 32 ? (~0u << (vocab % 32)) : 0u;  // bits past vocab
    if (rows > 0) c.bitmask[w] = static_cast<int32_t>(~0u);
    if (rows > 1) c.bitmask[c.bitmask_stride + w] = static_cast<int32_t>(rng() & tail);
    if (rows > 2) c.bitmask[2 * c.bitmask_stride + w] = static_cast<int32_t>(rng() & tail);
  }
  if (rows > 2) {
    const int64_t token = rng() % vocab;
    c.bitmask[2 * c.bitmask_stride + token / 32] |= static_cast<int32_t>(1u << (token % 32));
  }
  if (rows > 3) {
    c.logits[3 * c.row_stride + vocab / 2] = NAN;
    c.logits[3 * c.row_stride + vocab / 3] = INFINITY;
  }
  return c;
}

vpage::TokenBitmaskArgs apply_args(Rows& c) {
  vpage::TokenBitmaskArgs a;
  a.logits = c.logits.data();
  a.num_rows = c.rows;
  a.vocab = c.vocab;
  a.row_stride = c.row_stride;
  a.bitmask = c.bitmask.data();
  a.bitmask_stride = c.bitmask_stride;
  return a;
}

// torch's argmax over the row with its disallowed entries set to -inf (a NaN is the maximum).
int64_t reference_argmax(const Rows& c, int64_t r) {
  int64_t best = 0;
  float best_value = -INFINITY;
  for (int64_t t = 0; t < c.vocab; ++t) {
    const float v = allowed(c, r, t) ? c.logits[r * c.row_stride + t] : -INFINITY;
    if (std::isnan(v)) return t;
    if (v > best_value) best = t, best_value = v;
  }
  return best;
}

double reference_log_norm(const Rows& c, int64_t r) {
  const float* x = c.logits.data() + r * c.row_stride;
  double m = -INFINITY;
  for (int64_t t = 0; t < c.vocab; ++t) {
    if (std::isnan(x[t])) return NAN;
    m = std::max<double>(m, x[t]);
  }
  if (!std::isfinite(m)) return m;
  double sum = 0;
  for (int64_t t = 0; t < c.vocab; ++t) sum += std::exp(x[t] - m);
  return m + std::log(sum);
}

const int64_t kVocabs[] = {1, 31, 32, 33, 95, 1000, 4133, 49152};

}  // namespace

TEST_CASE("apply_token_bitmask: -inf exactly where the bit is 0, padding untouched") {
  for (const int64_t vocab : kVocabs) {
    for (const int threads : {1, 3}) {
      Rows c = make_case(6, vocab, 5, 2, static_cast<uint32_t>(vocab + threads));
      const std::vector<float> before = c.logits;
      vpage::cpu::apply_token_bitmask(apply_args(c), threads);
      for (int64_t r = 0; r < c.rows; ++r) {
        for (int64_t i = 0; i < c.row_stride; ++i) {
          const float old = before[r * c.row_stride + i], now = c.logits[r * c.row_stride + i];
          const bool masked = i < vocab && !allowed(c, r, i);
          const bool same = masked ? now == -INFINITY : (now == old || (std::isnan(now) && std::isnan(old)));
          EXPECT_MSG(same, "vocab " + std::to_string(vocab) + " row " + std::to_string(r) + " index " +
                               std::to_string(i));
        }
      }
    }
  }
}

TEST_CASE("logsumexp_argmax with a bitmask: allowed argmax, whole-row log_norm, poisoned outputs") {
  for (const int64_t vocab : kVocabs) {
    for (const int threads : {1, 3}) {
      Rows c = make_case(7, vocab, 3, 1, static_cast<uint32_t>(7 * vocab + threads));
      std::vector<float> log_norm(c.rows, NAN);
      std::vector<int64_t> argmax(c.rows, -5);
      vpage::LogsumexpArgmaxArgs a;
      a.logits = c.logits.data();
      a.num_rows = c.rows;
      a.vocab = vocab;
      a.row_stride = c.row_stride;
      a.log_norm = log_norm.data();
      a.argmax = argmax.data();
      a.bitmask = c.bitmask.data();
      a.bitmask_stride = c.bitmask_stride;
      vpage::cpu::logsumexp_argmax(a, threads);
      for (int64_t r = 0; r < c.rows; ++r) {
        const std::string where = "vocab " + std::to_string(vocab) + " row " + std::to_string(r);
        EXPECT_MSG(argmax[r] == reference_argmax(c, r),
                   where + ": argmax " + std::to_string(argmax[r]) + " != " + std::to_string(reference_argmax(c, r)));
        const double ref = reference_log_norm(c, r);
        const bool ok = std::isfinite(ref) ? std::fabs(log_norm[r] - ref) <= 1e-6 * std::max(1.0, std::fabs(ref))
                                           : (std::isnan(ref) ? std::isnan(log_norm[r]) : log_norm[r] == ref);
        EXPECT_MSG(ok, where + ": log_norm " + std::to_string(log_norm[r]) + " vs " + std::to_string(ref));
      }
    }
  }
}

TEST_CASE("token bitmask kernels: bad sizes throw") {
  Rows c = make_case(2, 100, 0, 0, 1);
  vpage::TokenBitmaskArgs a = apply_args(c);
  a.bitmask_stride = 3;  // < 4 words for 100 tokens
  EXPECT_THROWS_WITH(vpage::cpu::apply_token_bitmask(a, 1), vpage::CheckError, "bitmask_stride");
  a = apply_args(c);
  a.row_stride = 99;
  EXPECT_THROWS_WITH(vpage::cpu::apply_token_bitmask(a, 1), vpage::CheckError, "row_stride");
  std::vector<float> log_norm(2);
  std::vector<int64_t> argmax(2);
  vpage::LogsumexpArgmaxArgs l;
  l.logits = c.logits.data();
  l.num_rows = 2;
  l.vocab = 100;
  l.row_stride = 100;
  l.log_norm = log_norm.data();
  l.argmax = argmax.data();
  l.bitmask = c.bitmask.data();
  l.bitmask_stride = 3;
  EXPECT_THROWS_WITH(vpage::cpu::logsumexp_argmax(l, 1), vpage::CheckError, "bitmask_stride");
}

TEST_MAIN()
