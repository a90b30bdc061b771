// Internal: the block manager maps sequences' logical blocks to physical blocks of the GPU
// and CPU pools, with copy-on-write, fork, swap and prefix caching.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "block_pool.h"
#include "disk_tier.h"
#include "sequence_group.h"
#include "vpage/block_config.h"
#include "vpage/common.h"
#include "vpage/schedule_plan.h"

namespace vpage {

/// Answer of BlockManager::can_allocate / can_swap_in.
enum class AllocStatus : int32_t {
  kOk = 0,     ///< enough free blocks now
  kLater = 1,  ///< not now, but possible once other sequences free blocks
  kNever = 2,  ///< can never fit (more blocks than the pool minus the watermark)
};

/// Owns both pools. Every method keeps refcount(block) == number of block tables holding it
/// (between steps: during one, CPU blocks read or written by its tier moves are held too).
/// Not thread-safe: one scheduler drives it.
///
/// With enable_kv_offload the prefix cache has tiers: GPU entries evicted for reuse are copied
/// into the CPU pool (keeping their content ids, so chains span tiers), CPU entries evicted go
/// to the disk tier when there is one, and admission takes hits from the GPU, then the CPU
/// (swapped in before the forward), then the disk (read into the CPU a step ahead).
///
/// With a sliding window (config().sliding_window = W > 0) a sequence that has computed N
/// tokens holds no block before first_window_block(N): those entries are -1 (the table keeps
/// its length, so block index = position / block_size), and it holds blocks only up to the
/// tokens of its next step (at most `max_step_tokens` past N), so at most
/// max_window_blocks() blocks at any time instead of one per block_size tokens.
class BlockManager {
 public:
  /// `max_step_tokens` (> 0): the most tokens one step computes for a sequence (the
  /// scheduler's token budget); with a window, tables grow that far ahead of the computed ones.
  explicit BlockManager(const BlockManagerConfig& config, int32_t max_step_tokens = 1 << 30);

  const BlockManagerConfig& config() const { return config_; }
  int32_t block_size() const { return config_.block_size; }
  bool windowed() const { return config_.sliding_window > 0; }
  /// First block a sequence that computed `num_computed` tokens still needs: its next query
  /// (position num_computed) reads keys from num_computed - W + 1 on. 0 without a window.
  int32_t first_window_block(int32_t num_computed) const {
    return windowed() ? std::max(0, num_computed - config_.sliding_window + 1) / config_.block_size : 0;
  }
  /// With a window, the most blocks one sequence holds: ceil((W - 1 + max_step_tokens) /
  /// block_size) + 1.
  int32_t max_window_blocks() const { return max_window_blocks_; }

  /// Can `group` (all sequences waiting, no blocks) get blocks for all its tokens now (with
  /// a window: for the most it will hold at once)? kNever when that is more blocks than the
  /// pool holds minus the watermark.
  AllocStatus can_allocate(SequenceGroup& group);
  /// Gives every unfinished sequence a table for all its tokens (with a window: for its
  /// window and its next step). Identical sequences (a fresh prompt with n samples) share one
  /// set of blocks; sequences that diverged (after a recompute preemption) share the full
  /// blocks of their common prefix, which the first one computes. Full blocks already in the
  /// prefix cache are reused and counted as computed (never the one holding the last token).
  /// Precondition: can_allocate(group) != kNever and enough blocks are free.
  void allocate(SequenceGroup& group);

  /// Can every unfinished sequence of `group` get room for its newest token (with a window:
  /// for its next step's tokens), new blocks or copy-on-write copies?
  bool can_append_slots(const SequenceGroup& group) const;
  /// Makes room in each unfinished sequence's table for all its tokens (with a window: those
  /// of its next step, at most max_step_tokens). If the block its next token is written to
  /// is shared (after fork or parallel sampling), it is copied first and the (src, dst) pair
  /// appended to `copies`. While the group's sequences are still identical (one prompt
  /// computed once for all) nothing is copied and their tables follow the first one's.
  /// Precondition: can_append_slots(group).
  void append_slots(SequenceGroup& group, std::vector<BlockPair>& copies);

  /// Frees the blocks at the end of `seq`'s table that none of its tokens reaches (lookahead
  /// blocks of rejected draft tokens). A window's released entries are at the front, never
  /// among these.
  void free_lookahead(Sequence& seq);

  /// `child` gets `parent`'s table (no allocation; refcounts up). Precondition: child has none.
  void fork(const Sequence& parent, Sequence& child);
  /// Releases every block of `seq`'s table (full cached blocks stay reusable).
  void free(Sequence& seq);
  /// With a window: releases the blocks of `seq` (on the GPU) before
  /// first_window_block(num_computed), setting their entries to -1; freed cached blocks stay
  /// reusable. Call after its computed blocks were registered.
  void release_out_of_window(Sequence& seq);
  /// With a window, diverged sequences re-admitted after a recompute hold nothing while the
  /// group's first sequence computes their shared prefix (group.shared_len_ tokens); once it
  /// has, each of them takes that sequence's blocks of the prefix that lie in its window and
  /// continues from there, and the prefix is no longer pending. Call when the first
  /// sequence's computed tokens reach shared_len_, before it releases its own old blocks.
  void share_computed_prefix(SequenceGroup& group);
  /// Whether `seq` of `group` waits, holding nothing, for a shared prefix (see above).
  bool waits_for_prefix(const SequenceGroup& group, const Sequence& seq) const {
    return windowed() && group.shared_len_ > 0 && seq.num_computed_ < group.shared_len_ &&
           seq.block_table_.empty();
  }

  /// Are there enough free CPU blocks for all distinct blocks of the group's running sequences?
  bool can_swap_out(const SequenceGroup& group) const;
  /// Moves the group's running sequences to the CPU pool; a block shared inside the group
  /// moves once. Appends (gpu, cpu) pairs to `mapping`. Precondition: can_swap_out(group).
  void swap_out(SequenceGroup& group, std::vector<BlockPair>& mapping);
  /// Room (with the watermark, plus one block per sequence to decode) to bring the group back?
  AllocStatus can_swap_in(const SequenceGroup& group) const;
  /// Moves the group's swapped sequences back; appends (cpu, gpu) pairs to `mapping`.
  void swap_in(SequenceGroup& group, std::vector<BlockPair>& mapping);

  /// With a disk tier: reads the blocks of `group`'s prompt that only the disk holds into the
  /// CPU pool (kv loads of this step), so that its admission finds them there once they are
  /// read. Returns the number of blocks to load, 0 once tried.
  int32_t fetch_from_disk(SequenceGroup& group);
  /// Whether loads that fetch_from_disk started for `group` are still in flight (then it waits).
  bool waits_for_disk(SequenceGroup& group) const;
  /// Disk loads of earlier plans that finished: `done` ones are CPU cache entries like any other,
  /// `failed` ones (files missing, corrupt or of other content) are forgotten, and their files
  /// go with the next plan's kv_deletes.
  void complete_kv_loads(const std::vector<KvBlockLoad>& done, const std::vector<KvBlockLoad>& failed);
  /// A step's tier moves into `plan`: copies of the GPU entries evicted this step to the CPU
  /// (swap-outs), the CPU hits taken (swap-ins), disk saves of the CPU entries evicted, loads
  /// and deletes; then the CPU blocks held for those moves are released.
  void finish_step(SchedulePlan& plan);
  /// Indexes a block found on disk (a restart), as the most recent; returns the keys pushed
  /// out of a full tier (their files are to go).
  std::vector<BlockHash> add_disk_record(DiskRecord record);

  /// Offers the blocks of `seq` (of `group`) that became full and computed to the prefix cache.
  void register_computed_blocks(const SequenceGroup& group, Sequence& seq);

  /// Keyed hash of a cache salt (what SequenceGroup keeps beside the salt).
  BlockHash hash_salt(const std::string& salt) const;

  BlockUsage usage() const;
  /// Empties the GPU prefix cache when no GPU block is in use (else false; nothing changes).
  /// The lower tiers' entries go too (the disk tier's files with the next plan's kv_deletes).
  bool reset_prefix_cache();
  /// The GPU prefix cache's events since the last call (config().enable_kv_cache_events).
  std::vector<KvCacheEvent> take_events() { return gpu_.take_events(); }
  const BlockPool& gpu_pool() const { return gpu_; }
  const BlockPool& cpu_pool() const { return cpu_; }

  /// Checks both pools against the tables of `seqs` (every sequence that holds blocks), and
  /// that entries are -1 exactly before each sequence's window.
  void check_invariants(const std::vector<const Sequence*>& seqs) const;

 private:
  int32_t blocks_for(int32_t num_tokens) const;
  // Table entries `seq` needs before its next step: all its tokens, or with a window those
  // up to max_step_tokens past the computed ones.
  int32_t blocks_needed(int32_t num_tokens, int32_t num_computed) const;
  // (Draft tokens of the planned step hold slots too.)
  int32_t blocks_needed(const Sequence& seq) const {
    return blocks_needed(seq.num_tokens() + static_cast<int32_t>(seq.draft_tokens_.size()), seq.num_computed_);
  }
  // New blocks append_slots would allocate (copies not counted).
  int32_t blocks_to_grow(const SequenceGroup& group) const;
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
    // Blocks the group holds at most (with a window: all it will hold at once, capped by
    // what it would hold without one); admission needs them free.
    int32_t num_total_blocks = 0;
    int32_t num_new_blocks = 0;  // blocks allocate() takes from the free queue
    int32_t num_skipped = 0;     // leading hits before the window: not held (entries -1)
    int32_t num_hits = 0;        // hits held
    int32_t num_hits_free = 0;   // held hits on cached blocks nobody holds (they use a free block)
    // With a window: diverged sequences wait for the leader to compute their shared prefix;
    // else they take the leader's hits [shared_from, shared_to) (the prefix in their window).
    bool prefix_pending = false;
    int32_t shared_from = 0, shared_to = 0;
  };
  AdmissionPlan plan_admission(SequenceGroup& group);
  // Leading blocks of `seq` found in the prefix cache. Without `acquire`, their ids go to
  // hit_blocks_; with it, the first `skip` stay unheld (entries -1), the others are taken,
  // and the queries are counted.
  int32_t match_prefix(const SequenceGroup& group, Sequence& seq, bool acquire, int32_t skip);
  void move_group(SequenceGroup& group, Device to, std::vector<BlockPair>& mapping);
  BlockPool& pool(Device device) { return device == Device::kGpu ? gpu_ : cpu_; }
  bool offloads() const { return cpu_.caching_enabled() && !windowed(); }
  bool is_loading(BlockId cpu_block) const;
  // A CPU block that this step's moves read or write: held until finish_step.
  void hold_cpu(BlockId block) {
    cpu_.acquire_cached(block);
    held_cpu_.push_back(block);
  }
  // Distinct blocks held by the group's unfinished sequences.
  int32_t num_distinct_blocks(const SequenceGroup& group) const;

  BlockManagerConfig config_;
  BlockPool gpu_;
  BlockPool cpu_;
  DiskTier disk_;
  PrefixHasher hasher_;
  std::vector<BlockId> held_cpu_;
  std::vector<BlockId> swapped_in_cpu_;  // swap-in sources of this step, freed by finish_step
  std::vector<BlockPair> tier_swap_in_;  // (cpu, gpu) of CPU hits taken this step
  std::vector<KvBlockLoad> loading_;     // disk loads in flight (their CPU blocks held)
  std::vector<KvBlockLoad> plan_loads_;  // those started this step
  std::vector<std::pair<uint64_t, uint64_t>> tier_deletes_;  // files of failed loads
  int32_t watermark_blocks_;
  int32_t max_step_tokens_;
  int32_t max_window_blocks_;
  std::vector<BlockId> hit_blocks_;  // scratch of match_prefix
};

}  // namespace vpage
