// The sampler's row statistics (see sampler_ops.h). The row loops keep 16 float32 lanes of
// partial results, so GCC vectorises them; VPAGE_TARGET_CLONES compiles them for AVX-512,
// AVX2 and baseline x86-64, chosen at load time.
#include "vpage/kernels/sampler_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "exp_approx.h"
#include "target_clones.h"
#include "thread_pool.h"
#include "vpage/common.h"

namespace vpage::cpu {
namespace {

constexpr int kLanes = 16;

// Eight float lanes as a GNU vector (GCC, Clang). The select `a > b ? a : b` on it compiles to
// maxps in every clone; written over an array of lanes GCC 12 left it scalar, one maxss per
// value (logsumexp_argmax over [256, 49152] logits, 2 threads, Zen 3: 8.5 -> 7.7 ms median of
// 6 alternating runs; one row 75 -> 62 us).
typedef float Lanes8 __attribute__((vector_size(32)));

typedef int32_t Mask8 __attribute__((vector_size(32)));

// The largest value of x[0, n) (NaNs ignored: a comparison with NaN is false; -inf for none);
// *has_nan tells whether x holds a NaN (x != x), found in the same pass.
VPAGE_TARGET_CLONES
float row_max(const float* x, int64_t n, bool* has_nan) {
  const float low = -std::numeric_limits<float>::infinity();
  Lanes8 acc0 = {low, low, low, low, low, low, low, low}, acc1 = acc0;
  Mask8 nan = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    Lanes8 a, b;
    std::memcpy(&a, x + i, sizeof(a));
    std::memcpy(&b, x + i + 8, sizeof(b));
    acc0 = a > acc0 ? a : acc0;
    acc1 = b > acc1 ? b : acc1;
    nan |= (a != a) | (b != b);
  }
  float best = low;
  bool any_nan = false;
  for (; i < n; ++i) {
    best = x[i] > best ? x[i] : best;
    any_nan |= std::isnan(x[i]);
  }
  for (int l = 0; l < 8; ++l) {
    best = acc0[l] > best ? acc0[l] : best;
    best = acc1[l] > best ? acc1[l] : best;
    any_nan |= nan[l] != 0;
  }
  *has_nan = any_nan;
  return best;
}

constexpr int64_t kChunk = 512;  // exponentials buffered per chunk (on the stack)

// out[i] = exp(x[i] - m): an element-wise loop, which every clone vectorises.
VPAGE_TARGET_CLONES
void exp_shifted(float* out, const float* x, int64_t n, float m) {
  for (int64_t i = 0; i < n; ++i) out[i] = exp_clamped(x[i] - m);
}

VPAGE_TARGET_CLONES
float sum_lanes(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l];
  }
  float total = 0.0f;
  for (; i < n; ++i) total += x[i];
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  return total;
}

// sum(exp(x - m)) over x[0, n) for a finite m; NaN when x holds a NaN.
float row_sum_exp(const float* x, int64_t n, float m) {
  alignas(64) float buffer[kChunk];
  float total = 0.0f;
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t len = std::min(kChunk, n - i);
    exp_shifted(buffer, x + i, len, m);
    total += sum_lanes(buffer, len);
  }
  return total;
}

// The first index of `m` in x[0, n), or n: chunks are tested with a vectorised "any equal" first.
VPAGE_TARGET_CLONES
int64_t find_first(const float* x, int64_t n, float m) {
  constexpr int64_t kBlock = 64;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    int32_t any = 0;
    for (int64_t l = 0; l < kBlock; ++l) any |= x[i + l] == m;
    if (any) break;
  }
  for (; i < n; ++i) {
    if (x[i] == m) return i;
  }
  return n;
}

void one_row(const LogsumexpArgmaxArgs& a, int64_t r) {
  const float* x = a.logits + r * a.row_stride;
  const int64_t n = a.vocab;
  bool has_nan = false;
  const float m = row_max(x, n, &has_nan);
  float log_norm = std::numeric_limits<float>::quiet_NaN();  // rows that do not want it
  const bool wanted = a.want_log_norm == nullptr || a.want_log_norm[r] != 0;
  if (wanted && !has_nan && std::isfinite(m)) {
    log_norm = m + std::log(row_sum_exp(x, n, m));
  } else if (wanted && !has_nan) {
    log_norm = m;  // every entry -inf, or a +inf entry
  }
  int64_t index = 0;
  if (has_nan) {
    while (!std::isnan(x[index])) ++index;
    log_norm = std::numeric_limits<float>::quiet_NaN();
  } else {
    index = find_first(x, n, m);
    if (index == n) index = 0;  // a row of -inf: torch picks the first
  }
  a.log_norm[r] = log_norm;
  a.argmax[r] = index;
}

}  // namespace

void logsumexp_argmax(const LogsumexpArgmaxArgs& args, int num_threads) {
  VPAGE_CHECK(args.num_rows >= 0 && args.vocab > 0 && args.row_stride >= args.vocab,
              "logsumexp_argmax: bad sizes (num_rows " << args.num_rows << ", vocab " << args.vocab << ", row_stride "
                                                       << args.row_stride << ")");
  ThreadPool::instance().parallel_for(args.num_rows, std::max(num_threads, 1),
                                      [&](int64_t row, int) { one_row(args, row); });
}

}  // namespace vpage::cpu
