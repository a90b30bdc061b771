// The sampler's row statistics (see sampler_ops.h), with the argmax over the tokens a bitmask
// allows found in the same passes (one pass computes both maxima). The row loops keep 16 float32 lanes of
// partial results, so GCC vectorises them; VPAGE_TARGET_CLONES compiles them for AVX-512,
// AVX2 and baseline x86-64, chosen at load time.
#include "vpage/kernels/sampler_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "bitmask_lanes.h"
#include "exp_approx.h"
#include "target_clones.h"
#include "thread_pool.h"
#include "vpage/common.h"
#include "vpage/kernels/token_bitmask.h"

namespace vpage::cpu {
namespace {

constexpr int kLanes = 16;

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

// Pass 1 over a row with a bitmask `words`: the maximum of every entry and of the allowed ones
// (NaNs ignored, -inf for none), and whether the row holds a NaN. Per 8 lanes: the word's bits
// as a lane mask (and + compare), the allowed values (-inf elsewhere), two maxima.
struct MaskedRowMax {
  float max;
  float allowed_max;
  bool has_nan;
};

VPAGE_TARGET_CLONES
MaskedRowMax row_max_masked(const float* x, const int32_t* words, int64_t n) {
  const float low = -std::numeric_limits<float>::infinity();
  const Lanes8 lows = {low, low, low, low, low, low, low, low};
  Mask8 bits[4];
  std::memcpy(bits, kLaneBits, sizeof(bits));
  Lanes8 acc[4] = {lows, lows, lows, lows}, allowed_acc[4] = {lows, lows, lows, lows};
  Mask8 nan = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t full = n / 32;
  for (int64_t w = 0; w < full; ++w) {
    const Mask8 word = Mask8{} + words[w];
    for (int k = 0; k < 4; ++k) {
      Lanes8 a;
      std::memcpy(&a, x + 32 * w + 8 * k, sizeof(a));
      acc[k] = a > acc[k] ? a : acc[k];
      nan |= a != a;
      const Lanes8 allowed = (word & bits[k]) != 0 ? a : lows;
      allowed_acc[k] = allowed > allowed_acc[k] ? allowed : allowed_acc[k];
    }
  }
  MaskedRowMax out{low, low, false};
  for (int64_t i = 32 * full; i < n; ++i) {
    const bool allowed = (static_cast<uint32_t>(words[full]) >> (i % 32)) & 1u;
    out.max = x[i] > out.max ? x[i] : out.max;
    out.allowed_max = allowed && x[i] > out.allowed_max ? x[i] : out.allowed_max;
    out.has_nan |= std::isnan(x[i]);
  }
  for (int k = 0; k < 4; ++k) {
    for (int l = 0; l < 8; ++l) {
      out.max = acc[k][l] > out.max ? acc[k][l] : out.max;
      out.allowed_max = allowed_acc[k][l] > out.allowed_max ? allowed_acc[k][l] : out.allowed_max;
    }
  }
  for (int l = 0; l < 8; ++l) out.has_nan |= nan[l] != 0;
  return out;
}

// The first allowed index of x[0, n) holding `m` (or, with find_nan, a NaN: pass m = NaN
// then), or n. Words are tested with a vectorised "any hit" first.
VPAGE_TARGET_CLONES
int64_t find_first_allowed(const float* x, const int32_t* words, int64_t n, float m, bool find_nan) {
  const int32_t nan_bit = find_nan ? 1 : 0;
  const int64_t words_in_row = token_bitmask_words(n);
  for (int64_t w = 0; w < words_in_row; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    if (word == 0) continue;
    const float* p = x + 32 * w;
    const int64_t len = std::min<int64_t>(32, n - 32 * w);
    int32_t any = 0;
    if (len == 32) {
      for (int l = 0; l < 32; ++l) {
        any |= (static_cast<int32_t>(p[l] == m) | (static_cast<int32_t>(p[l] != p[l]) & nan_bit)) &
               static_cast<int32_t>(word >> l);
      }
      if ((any & 1) == 0) continue;
    }
    for (int64_t l = 0; l < len; ++l) {
      if (((word >> l) & 1u) && (p[l] == m || (find_nan && std::isnan(p[l])))) return 32 * w + l;
    }
  }
  return n;
}

// The argmax of torch over x with the disallowed entries replaced by -inf. A row holding a NaN
// (rare: a broken model) is searched for an allowed NaN first, one more pass.
int64_t masked_argmax(const float* x, const int32_t* words, int64_t n, const MaskedRowMax& s) {
  if (s.has_nan) {
    const int64_t index = find_first_allowed(x, words, n, std::numeric_limits<float>::quiet_NaN(), true);
    if (index < n) return index;
  }
  if (s.allowed_max == -std::numeric_limits<float>::infinity()) return 0;  // all -inf once masked
  return find_first_allowed(x, words, n, s.allowed_max, false);
}

void one_row(const LogsumexpArgmaxArgs& a, int64_t r) {
  const float* x = a.logits + r * a.row_stride;
  const int64_t n = a.vocab;
  const int32_t* words = a.bitmask == nullptr ? nullptr : a.bitmask + r * a.bitmask_stride;
  if (words != nullptr && allows_all(words, n)) words = nullptr;  // the unmasked passes
  bool has_nan = false;
  float m = 0.0f;
  MaskedRowMax masked{};
  if (words == nullptr) {
    m = row_max(x, n, &has_nan);
  } else {
    masked = row_max_masked(x, words, n);
    m = masked.max;
    has_nan = masked.has_nan;
  }
  float log_norm = std::numeric_limits<float>::quiet_NaN();  // rows that do not want it, NaN rows
  const bool wanted = a.want_log_norm == nullptr || a.want_log_norm[r] != 0;
  if (wanted && !has_nan && std::isfinite(m)) {
    log_norm = m + std::log(row_sum_exp(x, n, m));
  } else if (wanted && !has_nan) {
    log_norm = m;  // every entry -inf, or a +inf entry
  }
  int64_t index = 0;
  if (words != nullptr) {
    index = masked_argmax(x, words, n, masked);
  } else if (has_nan) {
    while (!std::isnan(x[index])) ++index;
  } else {
    index = find_first(x, n, m);
    if (index == n) index = 0;  // a row of -inf: torch picks the first
  }
  a.log_norm[r] = log_norm;
  a.argmax[r] = index;
}

}  // namespace

void logsumexp_argmax(const LogsumexpArgmaxArgs& args, int num_threads) {
  VPAGE_CHECK(args.num_rows >= 0 && args.vocab > 0 && args.row_stride >= args.vocab &&
                  (args.bitmask == nullptr || args.bitmask_stride >= token_bitmask_words(args.vocab)),
              "logsumexp_argmax: bad sizes (num_rows " << args.num_rows << ", vocab " << args.vocab << ", row_stride "
                                                       << args.row_stride << ", bitmask_stride "
                                                       << args.bitmask_stride << ")");
  ThreadPool::instance().parallel_for(args.num_rows, std::max(num_threads, 1),
                                      [&](int64_t row, int) { one_row(args, row); });
}

}  // namespace vpage::cpu
