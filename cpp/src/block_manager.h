// Internal: the block manager maps sequences' logical blocks to physical blocks of the GPU
// and CPU pools, with copy-on-write, fork, swap and prefix caching.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "block_pool.h"
#include "sequence_group.h"
#include "vpage/block_config.h"
#include "vpage/common.h"

namespace vpage {

/// Answer of BlockManager::can_allocate / can_swap_in.
enum class AllocStatus : int32_t {
  kOk = 0,     ///< enough free blocks now
  kLater = 1,  ///< not now, but possible once other sequences free blocks
  kNever = 2,  ///< can never fit (more blocks than the pool minus the watermark)
};

/// Owns both pools. Every method keeps refcount(block) == number of block tables holding it.
/// Not thread-safe: one scheduler drives it.
class BlockManager {
 public:
  explicit BlockManager(const BlockManagerConfig& config);

  const BlockManagerConfig& config() const { return config_; }
  int32_t block_size() const { return config_.block_size; }

  /// Can `group` (all sequences waiting, no blocks) get blocks for all its tokens now?
  /// kNever when it needs more blocks than the pool holds minus the watermark.
  AllocStatus can_allocate(SequenceGroup& group);
  /// Gives every unfinished sequence a table for all its tokens. Identical sequences (a
  /// fresh prompt with n samples) share one set of blocks; sequences that diverged (after a
  /// recompute preemption) share the full blocks of their common prefix, which the first one
  /// computes. Full blocks already in the prefix cache are reused and counted as computed
  /// (never the one holding the last token).
  /// Precondition: can_allocate(group) != kNever and enough blocks are free.
  void allocate(SequenceGroup& group);

  /// Can every unfinished sequence of `group` get room for its newest token (new blocks or
  /// copy-on-write copies)?
  bool can_append_slots(const SequenceGroup& group) const;
  /// Makes room in each unfinished sequence's table for all its tokens. If the block its
  /// next token is written to is shared (after fork or parallel sampling), it is copied
  /// first and the (src, dst) pair appended to `copies`. While the group's sequences are
  /// still identical (one prompt computed once for all) nothing is copied.
  /// Precondition: can_append_slots(group).
  void append_slots(SequenceGroup& group, std::vector<BlockPair>& copies);

  /// `child` gets `parent`'s table (no allocation; refcounts up). Precondition: child has none.
  void fork(const Sequence& parent, Sequence& child);
  /// Releases every block of `seq`'s table (full cached blocks stay reusable).
  void free(Sequence& seq);

  /// Are there enough free CPU blocks for all distinct blocks of the group's running sequences?
  bool can_swap_out(const SequenceGroup& group) const;
  /// Moves the group's running sequences to the CPU pool; a block shared inside the group
  /// moves once. Appends (gpu, cpu) pairs to `mapping`. Precondition: can_swap_out(group).
  void swap_out(SequenceGroup& group, std::vector<BlockPair>& mapping);
  /// Room (with the watermark, plus one block per sequence to decode) to bring the group back?
  AllocStatus can_swap_in(const SequenceGroup& group) const;
  /// Moves the group's swapped sequences back; appends (cpu, gpu) pairs to `mapping`.
  void swap_in(SequenceGroup& group, std::vector<BlockPair>& mapping);

  /// Offers the blocks of `seq` (of `group`) that became full and computed to the prefix cache.
  void register_computed_blocks(const SequenceGroup& group, Sequence& seq);

  /// Keyed hash of a cache salt (what SequenceGroup keeps beside the salt).
  BlockHash hash_salt(const std::string& salt) const;

  BlockUsage usage() const;
  const BlockPool& gpu_pool() const { return gpu_; }
  const BlockPool& cpu_pool() const { return cpu_; }

  /// Checks both pools against the tables of `seqs` (every sequence that holds blocks).
  void check_invariants(const std::vector<const Sequence*>& seqs) const;

 private:
  int32_t blocks_for(int32_t num_tokens) const;
  // Hashes of the first `num_blocks` full blocks of `seq` (computed once, then kept).
  void ensure_hashes(const SequenceGroup& group, Sequence& seq, int32_t num_blocks);
  // The recorded content of block `index` of `seq` whose previous block is entry `parent`.
  BlockContent content_of(const SequenceGroup& group, const Sequence& seq, int32_t index,
                          uint64_t parent) const;
  // What admitting a group takes: blocks in all, and prefix-cache hits (found without
  // counting them as queries).
  struct AdmissionPlan {
    bool identical = true;       // all unfinished sequences hold the same tokens
    int32_t shared_len = 0;      // leading tokens whose blocks all sequences share
    int32_t num_total_blocks = 0;
    int32_t num_hits = 0;
    int32_t num_hits_free = 0;   // hits on cached blocks nobody holds (they use a free block)
  };
  AdmissionPlan plan_admission(SequenceGroup& group);
  // Leading blocks of `seq` found in the prefix cache; with `acquire`, takes them and counts.
  int32_t match_prefix(const SequenceGroup& group, Sequence& seq, bool acquire,
                       int32_t* num_hits_free);
  void move_group(SequenceGroup& group, Device to, std::vector<BlockPair>& mapping);
  BlockPool& pool(Device device) { return device == Device::kGpu ? gpu_ : cpu_; }
  // Distinct blocks held by the group's unfinished sequences.
  int32_t num_distinct_blocks(const SequenceGroup& group) const;

  BlockManagerConfig config_;
  BlockPool gpu_;
  BlockPool cpu_;
  PrefixHasher hasher_;
  int32_t watermark_blocks_;
};

}  // namespace vpage
