// apply_token_bitmask (see vpage/kernels/token_bitmask.h). Words of all ones are skipped,
// words of zeros filled with -inf, mixed words blended branch-free with GNU vectors, so
// VPAGE_TARGET_CLONES compiles every path for AVX-512, AVX2 and baseline x86-64, chosen at load
// time. (Conditional stores instead of the blend, masked stores in the AVX clones, measured the
// same within the noise on Zen 4: one row of 151936 tokens 25-41 us either way.)
#include "vpage/kernels/token_bitmask.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "bitmask_lanes.h"
#include "target_clones.h"
#include "thread_pool.h"
#include "vpage/common.h"

namespace vpage::cpu {
namespace {

// Bitmask words (32 tokens each) per task: 16384 tokens, 64 KB of logits. A row of a large
// vocabulary is split over several tasks, so one row runs on every thread.
constexpr int64_t kWordsPerTask = 512;

// -inf into x[t] for the tokens t of [32 begin, min(32 end, n)) whose bit is 0.
VPAGE_TARGET_CLONES
void mask_words(float* x, const int32_t* words, int64_t begin, int64_t end, int64_t n) {
  const float low = -std::numeric_limits<float>::infinity();
  const Lanes8 lows = {low, low, low, low, low, low, low, low};
  Mask8 bits[4];
  std::memcpy(bits, kLaneBits, sizeof(bits));
  const int64_t full_end = std::min(end, n / 32);
  for (int64_t w = begin; w < full_end; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    if (word == ~0u) continue;
    float* p = x + 32 * w;
    if (word == 0) {
      for (int l = 0; l < 32; ++l) p[l] = low;
      continue;
    }
    const Mask8 word_lanes = Mask8{} + static_cast<int32_t>(word);
    for (int k = 0; k < 4; ++k) {
      Lanes8 a;
      std::memcpy(&a, p + 8 * k, sizeof(a));
      a = (word_lanes & bits[k]) != 0 ? a : lows;
      std::memcpy(p + 8 * k, &a, sizeof(a));
    }
  }
  if (full_end < end) {  // the partial last word of the row
    const uint32_t word = static_cast<uint32_t>(words[full_end]);
    for (int64_t t = 32 * full_end; t < n; ++t) {
      if (((word >> (t % 32)) & 1u) == 0) x[t] = low;
    }
  }
}

}  // namespace

void apply_token_bitmask(const TokenBitmaskArgs& args, int num_threads) {
  const int64_t words = token_bitmask_words(args.vocab);
  VPAGE_CHECK(args.num_rows >= 0 && args.vocab > 0 && args.row_stride >= args.vocab &&
                  args.bitmask_stride >= words,
              "apply_token_bitmask: bad sizes (num_rows " << args.num_rows << ", vocab " << args.vocab
                                                          << ", row_stride " << args.row_stride
                                                          << ", bitmask_stride " << args.bitmask_stride << ")");
  // Tasks: row r's word ranges [c kWordsPerTask, (c + 1) kWordsPerTask), c < tasks_per_row.
  const int64_t tasks_per_row = (words + kWordsPerTask - 1) / kWordsPerTask;
  ThreadPool::instance().parallel_for(args.num_rows * tasks_per_row, std::max(num_threads, 1),
                                      [&](int64_t task, int) {
                                        const int64_t r = task / tasks_per_row;
                                        const int64_t begin = task % tasks_per_row * kWordsPerTask;
                                        mask_words(args.logits + r * args.row_stride,
                                                   args.bitmask + r * args.bitmask_stride, begin,
                                                   std::min(words, begin + kWordsPerTask), args.vocab);
                                      });
}

}  // namespace vpage::cpu
