// Content hashes that name full KV blocks in the prefix cache.
#pragma once

#include <cstdint>
#include <string>

#include "vpage/common.h"

namespace vpage {

/// Hash of one full block: chained on the parent block's hash (0 for the first block),
/// this block's `num_tokens` token ids, and `extra_key` (the request's cache_salt hash), so
/// equal hashes mean equal token prefixes under the same salt. 64-bit: collisions are
/// possible in theory, at about 2^-64 per pair of distinct blocks.
uint64_t hash_block(uint64_t parent_hash, const TokenId* tokens, int32_t num_tokens,
                    uint64_t extra_key);

/// Hash of a cache salt string; the empty salt hashes to 0.
uint64_t hash_cache_salt(const std::string& salt);

}  // namespace vpage
