// Sizes of the KV-cache block pools as the scheduler takes them, and their occupancy as it
// reports it.
#pragma once

#include <cstdint>
#include <vector>

#include "vpage/common.h"

namespace vpage {

/// Sizes of the pools and the admission watermark.
struct BlockManagerConfig {
  int32_t block_size = 16;      ///< tokens per block (> 0)
  int32_t num_gpu_blocks = 0;   ///< blocks in the accelerator's KV cache
  int32_t num_cpu_blocks = 0;   ///< blocks in the CPU swap space
  double watermark = 0.01;      ///< fraction of GPU blocks kept free at admission
  bool enable_prefix_caching = true;
  /// Test hook: every block hashes to one constant, so every lookup meets a collision
  /// (hits stay exact: only blocks whose recorded content matches are shared).
  bool collide_prefix_hashes_for_testing = false;
  /// Sliding window W shared by every attention layer (a query at position p reads keys
  /// p - W < j <= p), 0 for none. With a window, blocks wholly before the window of a
  /// sequence's next query are freed and their block-table entries become -1.
  int32_t sliding_window = 0;
  /// Record a KvCacheEvent for every block that enters or leaves the GPU prefix cache
  /// (Scheduler::take_kv_events); off, nothing is recorded.
  bool enable_kv_cache_events = false;
  /// The CPU pool doubles as a tier of the prefix cache (needs enable_prefix_caching): GPU
  /// entries evicted for reuse are copied into free CPU blocks, least recently used first out
  /// (a swap-out takes such blocks like any free one), and admission swaps hits there back in
  /// instead of recomputing them. Sliding-window models keep to the GPU cache.
  bool enable_kv_offload = false;
  /// Blocks of the disk tier below the CPU pool (0: none; needs enable_kv_offload): entries
  /// the CPU pool evicts are written to disk, and admission reads hits there into the CPU pool
  /// a step before it takes them (SchedulePlan::kv_saves / kv_loads).
  int32_t num_disk_blocks = 0;
  /// Key of the block hashes; both 0: drawn per process. A disk tier's own key keeps the names
  /// of its files valid across restarts.
  uint64_t prefix_hash_key0 = 0, prefix_hash_key1 = 0;
};

/// A change of the GPU prefix cache as routers that follow it read it (vLLM's KV events): a
/// full computed block entered the cache, or a cached block was evicted for reuse. A block is
/// named by its 128-bit chained content hash (hi, lo), which covers its parent's hash (the
/// salt's for a first block: the request's cache salt and LoRA adapter) and its tokens. The
/// key is drawn per process: the names are stable within one engine, not across engines.
struct KvCacheEvent {
  enum class Kind : int32_t { kStored = 0, kRemoved = 1, kAllCleared = 2 };  ///< kAllCleared: reset_prefix_cache
  Kind kind = Kind::kStored;
  uint64_t hash_hi = 0, hash_lo = 0;
  bool has_parent = false;  ///< kStored: false for a sequence's first block
  uint64_t parent_hi = 0, parent_lo = 0;
  int32_t lora_id = 0;             ///< kStored: the adapter of the request that computed it (0: none)
  std::vector<TokenId> token_ids;  ///< kStored: the block's block_size tokens
};

/// Counters of one tier of the prefix cache, in blocks.
struct PrefixCacheStats {
  int64_t queries = 0;    ///< full blocks looked up
  int64_t hits = 0;       ///< lookups that found a cached block
  int64_t evictions = 0;  ///< cached blocks reused for other content
  int64_t collisions = 0; ///< hash matches whose recorded content differed (each a miss)
};

/// Occupancy of both pools and the prefix-cache counters.
struct BlockUsage {
  int32_t num_gpu_blocks = 0, free_gpu_blocks = 0;
  int32_t num_cpu_blocks = 0, free_cpu_blocks = 0;
  PrefixCacheStats prefix_cache;
  /// The lower tiers (enable_kv_offload, num_disk_blocks): lookups of blocks the tiers above missed.
  PrefixCacheStats cpu_prefix_cache, disk_prefix_cache;
  int32_t num_disk_blocks = 0, used_disk_blocks = 0;
};

}  // namespace vpage
