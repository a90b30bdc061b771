// Internal: the index of the KV blocks kept on disk, the tier below the CPU pool.
#pragma once

#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

#include "prefix_hash.h"
#include "vpage/block_config.h"
#include "vpage/common.h"

namespace vpage {

/// What a block on disk holds, as its file's header records it. The key chains the salt and
/// every earlier block; the block's own tokens (and a first block's salt) are compared exactly
/// on every hit, so a hit differs from the asked content only if two keyed 128-bit chains
/// collide.
struct DiskRecord {
  BlockHash hash;
  bool first = false;  ///< a sequence's first block: `salt` is its cache salt
  std::string salt;
  std::vector<TokenId> tokens;
};

/// Least-recently-used index of at most `capacity` records; the worker holds the files.
class DiskTier {
 public:
  DiskTier(int32_t capacity, int32_t block_size);

  bool enabled() const { return capacity_ > 0; }
  int32_t size() const { return static_cast<int32_t>(index_.size()); }

  /// Whether a record under `hash` holds exactly these tokens (and, for a first block, this
  /// salt); a hit becomes the most recent. With `count`, records a query (and a hit).
  bool lookup(const BlockHash& hash, const TokenId* tokens, bool first, const std::string& salt, bool count);
  /// Adds `record` as the most recent, appending the keys it pushes out (least recent first) to
  /// `evicted`. Returns false, changing nothing, when its key is indexed already.
  bool insert(DiskRecord record, std::vector<BlockHash>& evicted);
  void erase(const BlockHash& hash);
  /// Forgets every record, appending their keys to `gone`.
  void clear(std::vector<BlockHash>& gone);
  const PrefixCacheStats& stats() const { return stats_; }

 private:
  int32_t capacity_;
  int32_t block_size_;
  std::list<DiskRecord> lru_;  // front: least recent
  std::unordered_map<BlockHash, std::list<DiskRecord>::iterator, BlockHashHasher> index_;
  PrefixCacheStats stats_;
};

}  // namespace vpage
