// One pool of KV-cache blocks (GPU or CPU): reference counts, an O(1) free queue and,
// optionally, the prefix-cache index of full blocks.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "vpage/common.h"

namespace vpage {

/// Counters of the prefix cache (only the GPU pool caches).
struct PrefixCacheStats {
  int64_t queries = 0;    ///< full blocks looked up
  int64_t hits = 0;       ///< lookups that found a cached block
  int64_t evictions = 0;  ///< cached blocks reused for other content
};

/// Allocator of `num_blocks` blocks. Free blocks sit in an intrusive doubly linked queue:
/// allocate() takes the front (least recently freed), decref() to zero appends at the back,
/// and a cached free block can be taken out of the middle on a prefix-cache hit; all O(1).
/// A freed block keeps its hash (stays reusable) until allocate() evicts it.
class BlockPool {
 public:
  /// `num_blocks` >= 0; `enable_caching` keeps a hash -> block index of full blocks.
  BlockPool(Device device, int32_t num_blocks, bool enable_caching);

  Device device() const { return device_; }
  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_free() const { return num_free_; }
  int32_t num_used() const { return num_blocks_ - num_free_; }
  bool caching_enabled() const { return caching_; }

  /// Takes the front block of the free queue with refcount 1, evicting its cached hash.
  /// Precondition: num_free() > 0.
  BlockId allocate();
  /// Adds a reference to a block in use (refcount > 0).
  void incref(BlockId block);
  /// Drops a reference; at zero the block joins the back of the free queue.
  /// Throws CheckError on a double free.
  void decref(BlockId block);
  int32_t refcount(BlockId block) const { return refcount_.at(check_id(block)); }

  /// Cached block holding content `hash`, or -1. With `count`, records a query (and a hit).
  BlockId lookup(uint64_t hash, bool count);
  /// Takes a reference on a block found by lookup(): leaves the free queue if it was free.
  void acquire_cached(BlockId block);
  /// Records that `block` (in use, full, computed) holds content `hash`. No-op when that
  /// content is already cached in another block or the block already has a hash.
  void register_hash(BlockId block, uint64_t hash);
  bool has_hash(BlockId block) const { return hashed_.at(check_id(block)) != 0; }

  const PrefixCacheStats& cache_stats() const { return stats_; }

  /// Verifies refcounts against `expected_refcounts` (one entry per block, counted from
  /// the block tables), the free queue and the cache index; throws CheckError on a mismatch.
  void check_invariants(const std::vector<int32_t>& expected_refcounts) const;

 private:
  size_t check_id(BlockId block) const;
  void unlink(BlockId block);
  void push_back(BlockId block);
  void drop_hash(BlockId block);

  Device device_;
  int32_t num_blocks_;
  bool caching_;
  int32_t num_free_ = 0;
  std::vector<int32_t> refcount_;
  // Free queue links; index num_blocks_ is the sentinel. -1 = not in the queue.
  std::vector<int32_t> prev_;
  std::vector<int32_t> next_;
  std::vector<uint64_t> hash_;
  std::vector<uint8_t> hashed_;
  std::unordered_map<uint64_t, BlockId> cached_;
  PrefixCacheStats stats_;
};

}  // namespace vpage
