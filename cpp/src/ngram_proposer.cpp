#include "ngram_proposer.h"

#include <algorithm>

namespace vpage {

void propose_ngram(const TokenId* tokens, int32_t num_tokens, int32_t min_n, int32_t max_n,
                   int32_t max_drafts, std::vector<TokenId>& drafts) {
  drafts.clear();
  if (max_drafts <= 0) return;
  for (int32_t n = std::min(max_n, num_tokens - 1); n >= min_n; --n) {
    const TokenId* suffix = tokens + num_tokens - n;
    // Occurrences that end before the suffix itself starts to overlap its last token, latest
    // first: a match at `start` proposes tokens[start + n, ...).
    for (int32_t start = num_tokens - n - 1; start >= 0; --start) {
      if (!std::equal(suffix, suffix + n, tokens + start)) continue;
      const int32_t from = start + n;
      const int32_t count = std::min(max_drafts, num_tokens - from);
      drafts.assign(tokens + from, tokens + from + count);
      return;
    }
  }
}

}  // namespace vpage
