// Internal: draft tokens by n-gram prompt lookup (speculative decoding without a draft model).
#pragma once

#include <cstdint>
#include <vector>

#include "vpage/common.h"

namespace vpage {

/// Proposes up to `max_drafts` tokens that continue `tokens[0, num_tokens)`: for n from
/// `max_n` down to `min_n` (1 <= min_n <= max_n), it looks for the latest earlier occurrence
/// of the last n tokens and proposes the tokens that followed it. The first n with a match
/// wins. Replaces `drafts` (empty when nothing matches). O(num_tokens * max_n).
void propose_ngram(const TokenId* tokens, int32_t num_tokens, int32_t min_n, int32_t max_n,
                   int32_t max_drafts, std::vector<TokenId>& drafts);

}  // namespace vpage
