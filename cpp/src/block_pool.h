// Internal: one pool of KV-cache blocks (GPU or CPU): reference counts, an O(1) free queue
// and, optionally, the prefix-cache index of full blocks.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "prefix_hash.h"
#include "vpage/block_config.h"
#include "vpage/common.h"

namespace vpage {

/// What a full block holds, recorded when it enters the prefix cache and compared exactly
/// on every hit. A block's salt is its chain's: it is recorded and compared for first
/// blocks only, later blocks inherit it through `parent`.
struct BlockContent {
  const TokenId* tokens = nullptr;    ///< [block_size] token ids of the block
  uint64_t parent = 0;                ///< content id of the previous block (kFirstBlock for none)
  const std::string* salt = nullptr;  ///< cache salt of the request (first blocks); null = ""
};

/// Content ids name cache entries: unique per pool (or per pair of pools sharing them), never
/// reused, so a parent that was evicted can never be confused with new content in the same
/// block. An entry copied to another pool of the pair keeps its id, so chains span pools.
constexpr uint64_t kFirstBlock = 0;                 ///< `parent` of a sequence's first block
constexpr uint64_t kNoContent = ~uint64_t{0};       ///< not in the cache (nothing can chain on it)

/// A cache entry as it left a pool (allocate() evicted it), for a lower tier to keep.
struct EvictedEntry {
  BlockId block = -1;  ///< the block it was in (now reallocated: copy it out before writing it)
  BlockHash hash;
  uint64_t cid = kNoContent, parent = kNoContent;
  std::string salt;
  std::vector<TokenId> tokens;
  BlockContent content() const { return BlockContent{tokens.data(), parent, &salt}; }
};

/// Allocator of `num_blocks` blocks. Free blocks sit in an intrusive doubly linked queue:
/// allocate() takes the front (least recently freed), decref() to zero appends at the back,
/// and a cached free block can be taken out of the middle on a prefix-cache hit; all O(1).
/// A freed block keeps its hash (stays reusable) until allocate() evicts it.
class BlockPool {
 public:
  /// `num_blocks` >= 0; `enable_caching` keeps a hash -> block index of full blocks of
  /// `block_size` tokens (> 0 when caching) with their recorded contents.
  BlockPool(Device device, int32_t num_blocks, bool enable_caching, int32_t block_size = 16);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_free() const { return num_free_; }
  int32_t num_used() const { return num_blocks_ - num_free_; }
  bool caching_enabled() const { return caching_; }
  int32_t block_size() const { return block_size_; }

  /// Takes the front block of the free queue with refcount 1, evicting its cached hash.
  /// Precondition: num_free() > 0.
  BlockId allocate();
  /// Adds a reference to a block in use (refcount > 0).
  void incref(BlockId block);
  /// Drops a reference; at zero the block joins the back of the free queue.
  /// Throws CheckError on a double free.
  void decref(BlockId block);
  int32_t refcount(BlockId block) const { return refcount_.at(check_id(block)); }

  /// Cached block indexed by `hash` whose recorded content equals `content`, or -1 (a
  /// different content under that hash is a miss, counted as a collision). With `count`,
  /// records a query (and a hit).
  BlockId lookup(const BlockHash& hash, const BlockContent& content, bool count);
  /// Takes a reference on a block found by lookup(): leaves the free queue if it was free.
  void acquire_cached(BlockId block);
  /// Offers `block` (in use, full, computed) to the cache as holding `content` under
  /// `hash`. Returns the content id of the entry that now holds that content: the block's
  /// own (new, or kept if it was already cached), or an equal entry's in another block.
  /// Returns kNoContent when caching is off, `content.parent` is kNoContent, or another
  /// content holds `hash` (a collision, counted). A new entry takes content id `cid` when
  /// given (the same content copied from the other pool of a pair), else a fresh one.
  uint64_t register_block(BlockId block, const BlockHash& hash, const BlockContent& content,
                          uint64_t cid = kNoContent);
  /// Content id of a cached block, kNoContent when it holds none.
  uint64_t content_id(BlockId block) const { return cid_.at(check_id(block)); }

  const PrefixCacheStats& cache_stats() const { return stats_; }
  /// Records `n` queries that missed without a lookup (blocks after a chain's first miss).
  void count_misses(int64_t n) { stats_.queries += n; }

  /// Empties the prefix cache (one kAllCleared event, no kRemoved ones) when no block is in
  /// use; returns false, changing nothing, when one is.
  bool reset_cache();
  /// Forgets the entry of free `block` if it is the one under `hash`; returns whether it was.
  bool drop_entry(BlockId block, const BlockHash& hash);
  /// Forgets the entries of free blocks (no events); blocks in use hold none in a pool whose
  /// entries are only copies (the CPU tier).
  void drop_free_entries();

  /// Makes this pool draw content ids from `other`'s counter (a tier pair), so that an
  /// entry copied across keeps its id. `other` outlives this pool.
  void share_content_ids(BlockPool& other) { next_cid_ = other.next_cid_; }
  /// With `on`, allocate() keeps every entry it evicts for take_evicted().
  void set_keep_evicted(bool on) { keep_evicted_ = on; }
  std::vector<EvictedEntry> take_evicted();

  /// With `on`, every cache entry dropped by allocate() is logged as a kRemoved event, and
  /// record_stored() logs kStored ones; take_events() hands the log over in order.
  void set_record_events(bool on) { record_events_ = on; }
  /// Logs that `block`'s entry, just made by register_block(), holds hash `hash` chained on
  /// `parent` (null for a first block) under LoRA adapter `lora_id`.
  void record_stored(BlockId block, const BlockHash& hash, const BlockHash* parent, int32_t lora_id);
  std::vector<KvCacheEvent> take_events();

  /// Verifies refcounts against `expected_refcounts` (one entry per block, counted from
  /// the block tables), the free queue and the cache index; throws CheckError on a mismatch.
  void check_invariants(const std::vector<int32_t>& expected_refcounts) const;

 private:
  size_t check_id(BlockId block) const;
  void unlink(BlockId block);
  void push_back(BlockId block);
  void drop_hash(BlockId block);
  bool same_content(BlockId block, const BlockContent& content) const;

  Device device_;
  int32_t num_blocks_;
  bool caching_;
  int32_t block_size_;
  int32_t num_free_ = 0;
  std::vector<int32_t> refcount_;
  // Free queue links; index num_blocks_ is the sentinel. -1 = not in the queue.
  std::vector<int32_t> prev_;
  std::vector<int32_t> next_;
  // Prefix cache: per block its index key, content id (kNoContent = not cached), recorded
  // parent, salt (first blocks) and tokens ([num_blocks, block_size]).
  std::vector<BlockHash> hash_;
  std::vector<uint64_t> cid_;
  std::vector<uint64_t> parent_;
  std::vector<std::string> salt_;
  std::vector<TokenId> tokens_;
  std::unordered_map<BlockHash, BlockId, BlockHashHasher> cached_;
  uint64_t own_next_cid_ = 1;
  uint64_t* next_cid_ = &own_next_cid_;  // this pool's counter or the pair's (share_content_ids)
  PrefixCacheStats stats_;
  bool keep_evicted_ = false;
  std::vector<EvictedEntry> evicted_;
  bool record_events_ = false;
  std::vector<KvCacheEvent> events_;
};

}  // namespace vpage
