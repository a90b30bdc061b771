// Internal: keyed content hashes that index full KV blocks in the prefix cache.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "vpage/common.h"

namespace vpage {

/// 128-bit name of a block's content. It only indexes the prefix cache: every hit is
/// verified against the block's recorded content (BlockPool::lookup), so a collision
/// costs a miss, never a wrong block.
struct BlockHash {
  uint64_t lo = 0, hi = 0;
  bool operator==(const BlockHash& o) const { return lo == o.lo && hi == o.hi; }
  bool operator!=(const BlockHash& o) const { return !(*this == o); }
};

/// std::hash-style functor for BlockHash keys (the low half is already uniform).
struct BlockHashHasher {
  size_t operator()(const BlockHash& h) const { return static_cast<size_t>(h.lo); }
};

/// SipHash-2-4 with a 128-bit output over `len` bytes of `data`, keyed with (k0, k1).
BlockHash siphash128(uint64_t k0, uint64_t k1, const void* data, size_t len);

/// Hashes block contents with a key drawn once per process from std::random_device (or one
/// given: a disk tier's, kept secret beside its files so names outlive the process), so
/// block names cannot be predicted (or collisions searched for) from outside.
/// Blocks use SipHash-1-3 (the keyed variant hash tables use against flooding: a collision
/// here is only ever a miss, since hits are verified), salts SipHash-2-4.
/// Cost: one pass over 16 + 4 * block_size bytes per full block.
class PrefixHasher {
 public:
  /// `collide_for_testing` makes every block hash to one constant (a test hook that
  /// forces collisions; lookups stay exact, they just miss).
  /// A nonzero (`k0`, `k1`) replaces the process's key.
  explicit PrefixHasher(bool collide_for_testing = false, uint64_t k0 = 0, uint64_t k1 = 0);

  /// Chained hash of one full block: the parent block's hash (for the first block, zero
  /// parent, the cache salt's hash instead) and this block's `num_tokens` token ids.
  BlockHash hash_block(const BlockHash& parent, const BlockHash& salt, const TokenId* tokens,
                       int32_t num_tokens) const;
  /// Hash of a cache salt string; the empty salt hashes to zero.
  BlockHash hash_salt(const std::string& salt) const;

 private:
  uint64_t k0_, k1_;
  bool collide_;
};

}  // namespace vpage
