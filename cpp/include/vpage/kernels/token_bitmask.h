// Token bitmasks of structured outputs (xgrammar's layout): per row, int32 words where bit
// t % 32 of word t / 32 set means token t is allowed. The grammar backends fill them; the
// sampler applies them to the logits (apply_token_bitmask) or takes the argmax over the allowed
// tokens only (LogsumexpArgmaxArgs::bitmask).
#pragma once

#include <cstdint>

namespace vpage {

/// int32 words of one bitmask row over `vocab` tokens.
inline constexpr int64_t token_bitmask_words(int64_t vocab) { return (vocab + 31) / 32; }

/// Rows of float32 logits [num_rows, vocab] (columns contiguous, rows `row_stride` apart) and
/// their bitmask rows (int32 [num_rows, bitmask_stride], bitmask_stride >=
/// token_bitmask_words(vocab); bits past the vocabulary are ignored).
struct TokenBitmaskArgs {
  float* logits = nullptr;
  int64_t num_rows = 0;
  int64_t vocab = 0;
  int64_t row_stride = 0;  // elements, >= vocab
  const int32_t* bitmask = nullptr;
  int64_t bitmask_stride = 0;  // words
};

namespace cpu {

/// In place: logits[r][t] = -inf wherever bit t of bitmask row r is 0 (other entries, NaN
/// included, are untouched; words of all ones are skipped without touching their logits).
/// Multi-threaded over rows and over ranges of each row's vocabulary. Throws
/// vpage::CheckError on bad sizes.
void apply_token_bitmask(const TokenBitmaskArgs& args, int num_threads);

}  // namespace cpu
}  // namespace vpage
