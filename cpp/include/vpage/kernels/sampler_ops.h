// Row statistics of a step's logits for the sampler: the log-normaliser (logsumexp) and the
// first maximum of each row, in two passes over the row instead of torch's separate
// logsumexp and argmax (which also materialise a temporary per row).
#pragma once

#include <cstdint>

#include "vpage/common.h"

namespace vpage {

/// Rows of float32 logits [num_rows, vocab] (columns contiguous, rows `row_stride` apart).
struct LogsumexpArgmaxArgs {
  const float* logits = nullptr;
  int64_t num_rows = 0;
  int64_t vocab = 0;
  int64_t row_stride = 0;      // elements, >= vocab
  float* log_norm = nullptr;   // [num_rows] out: log(sum(exp(row)))
  int64_t* argmax = nullptr;   // [num_rows] out: index of the row's first maximum
  // [num_rows] or null (every row): rows with 0 skip the sum of exponentials (one pass over
  // the row instead of two) and get a NaN log_norm.
  const uint8_t* want_log_norm = nullptr;
  // int32 [num_rows, bitmask_stride] token bitmask (see token_bitmask.h) or null: the argmax
  // is then over the allowed tokens only; log_norm stays that of the whole row.
  const int32_t* bitmask = nullptr;
  int64_t bitmask_stride = 0;  // words, >= token_bitmask_words(vocab)
};

namespace cpu {

/// Per row: argmax = the first index of the maximum (as torch.argmax: exact comparisons, the
/// first of equal maxima; a NaN counts as the maximum), log_norm = max + log(sum(exp(x - max)))
/// with exp by a polynomial within ~1 ulp of expf (float32 lanes, so within a few 1e-7
/// relative of a float64 logsumexp). A row of -inf gives -inf and index 0; a row holding +inf
/// gives +inf; a row holding NaN gives NaN and the first NaN's index. Rows that
/// ``want_log_norm`` leaves out get only the argmax (log_norm NaN). With a bitmask, the argmax
/// is torch's over the row with its disallowed entries replaced by -inf (so 0 for a row that
/// allows no token, or only -inf ones), found in the same passes (a row whose bitmask allows
/// every token costs one extra read of its bitmask words). One row per task, multi-threaded
/// over rows. Throws vpage::CheckError on bad sizes.
void logsumexp_argmax(const LogsumexpArgmaxArgs& args, int num_threads);

}  // namespace cpu
}  // namespace vpage
