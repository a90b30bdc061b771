// The lower tiers of the prefix cache (BlockManagerConfig::enable_kv_offload, num_disk_blocks):
// GPU entries evicted into the CPU pool, CPU entries evicted to the disk index, and disk blocks
// read back ahead of admission. The hits themselves are taken in match_prefix.
#include <algorithm>

#include "block_manager.h"

namespace vpage {

int32_t BlockManager::fetch_from_disk(SequenceGroup& group) {
  if (!disk_.enabled() || group.disk_fetched_) return 0;
  group.disk_fetched_ = true;
  Sequence* leader = nullptr;
  for (auto& s : group.seqs_) {
    if (!is_finished(s->status())) {
      leader = s.get();
      break;
    }
  }
  if (leader == nullptr) return 0;
  const int32_t bs = config_.block_size;
  const int32_t cacheable = (leader->num_tokens() - 1) / bs;
  ensure_hashes(group, *leader, cacheable);
  // Past the blocks the tiers above hold, to the first the disk lacks.
  int32_t i = 0;
  uint64_t parent = kFirstBlock;
  for (; i < cacheable; ++i) {
    const BlockContent content = content_of(group, *leader, i, parent);
    BlockId b = gpu_.lookup(leader->block_hashes_[i], content, false);
    if (b >= 0) {
      parent = gpu_.content_id(b);
      continue;
    }
    b = cpu_.lookup(leader->block_hashes_[i], content, false);
    if (b < 0) break;
    parent = cpu_.content_id(b);
  }
  int32_t loads = 0;
  for (; i < cacheable && cpu_.num_free() > 0; ++i, ++loads) {
    const BlockHash& hash = leader->block_hashes_[i];
    if (!disk_.lookup(hash, leader->tokens_.data() + static_cast<size_t>(i) * bs, i == 0, group.cache_salt_, true)) break;
    const BlockId c = cpu_.allocate();
    parent = cpu_.register_block(c, hash, content_of(group, *leader, i, parent));
    if (parent == kNoContent) {  // another content holds the key in the CPU index
      held_cpu_.push_back(c);
      break;
    }
    // Held (the allocation's reference) until complete_kv_loads: the read may take steps.
    loading_.push_back(KvBlockLoad{hash.hi, hash.lo, c});
    plan_loads_.push_back(loading_.back());
    group.loading_blocks_.push_back(c);
  }
  return loads;
}

void BlockManager::finish_step(SchedulePlan& plan) {
  if (!offloads()) return;
  // GPU entries evicted this step: copied to the CPU before this step's forward writes them.
  // A chain is evicted from its end, so the latest evicted are the nearest its start: they go
  // first (a chain's later blocks are worth nothing without them) while the CPU has room.
  const std::vector<EvictedEntry> evicted = gpu_.take_evicted();
  for (auto it = evicted.rbegin(); it != evicted.rend(); ++it) {
    const EvictedEntry& e = *it;
    if (cpu_.num_free() == 0 || cpu_.lookup(e.hash, e.content(), false) >= 0) continue;
    const BlockId c = cpu_.allocate();
    held_cpu_.push_back(c);  // a later copy of this step must not take it
    if (cpu_.register_block(c, e.hash, e.content(), e.cid) != kNoContent) plan.blocks_to_swap_out.emplace_back(e.block, c);
  }
  // CPU entries evicted this step: written to disk before their blocks are rewritten. A key
  // pushed out of the disk in the same step is not written at all.
  std::vector<BlockHash> gone;
  for (EvictedEntry& e : cpu_.take_evicted()) {
    KvBlockSave save{e.block, e.hash.hi, e.hash.lo, e.parent == kFirstBlock, e.salt, e.tokens};
    if (disk_.insert(DiskRecord{e.hash, save.first, std::move(e.salt), std::move(e.tokens)}, gone)) {
      plan.kv_saves.push_back(std::move(save));
    }
  }
  for (const BlockHash& h : gone) {
    const auto same = [&](const KvBlockSave& s) { return s.hash_hi == h.hi && s.hash_lo == h.lo; };
    const auto it = std::find_if(plan.kv_saves.begin(), plan.kv_saves.end(), same);
    if (it != plan.kv_saves.end()) {
      plan.kv_saves.erase(it);
    } else {
      plan.kv_deletes.emplace_back(h.hi, h.lo);
    }
  }
  plan.kv_deletes.insert(plan.kv_deletes.end(), tier_deletes_.begin(), tier_deletes_.end());
  tier_deletes_.clear();
  plan.blocks_to_swap_in.insert(plan.blocks_to_swap_in.end(), tier_swap_in_.begin(), tier_swap_in_.end());
  tier_swap_in_.clear();
  plan.kv_loads.swap(plan_loads_);
  plan_loads_.clear();
  for (BlockId c : held_cpu_) cpu_.decref(c);
  held_cpu_.clear();
  for (BlockId c : swapped_in_cpu_) cpu_.decref(c);
  swapped_in_cpu_.clear();
}

bool BlockManager::is_loading(BlockId cpu_block) const {
  return std::any_of(loading_.begin(), loading_.end(), [&](const KvBlockLoad& l) { return l.cpu_block == cpu_block; });
}

bool BlockManager::waits_for_disk(SequenceGroup& group) const {
  auto& blocks = group.loading_blocks_;
  blocks.erase(std::remove_if(blocks.begin(), blocks.end(), [&](BlockId c) { return !is_loading(c); }), blocks.end());
  return !blocks.empty();
}

void BlockManager::complete_kv_loads(const std::vector<KvBlockLoad>& done, const std::vector<KvBlockLoad>& failed) {
  const auto finish = [&](const KvBlockLoad& load) {
    const auto same = [&](const KvBlockLoad& l) {
      return l.cpu_block == load.cpu_block && l.hash_hi == load.hash_hi && l.hash_lo == load.hash_lo;
    };
    const auto it = std::find_if(loading_.begin(), loading_.end(), same);
    VPAGE_CHECK(it != loading_.end(), "no disk load of block " << load.cpu_block << " is in flight");
    loading_.erase(it);
    cpu_.decref(load.cpu_block);
  };
  for (const KvBlockLoad& load : done) finish(load);
  for (const KvBlockLoad& load : failed) {
    finish(load);
    const BlockHash hash{load.hash_lo, load.hash_hi};
    cpu_.drop_entry(load.cpu_block, hash);
    disk_.erase(hash);
    tier_deletes_.emplace_back(load.hash_hi, load.hash_lo);
  }
}

std::vector<BlockHash> BlockManager::add_disk_record(DiskRecord record) {
  std::vector<BlockHash> gone;
  disk_.insert(std::move(record), gone);
  return gone;
}

bool BlockManager::reset_prefix_cache() {
  if (!gpu_.reset_cache()) return false;
  cpu_.drop_free_entries();
  std::vector<BlockHash> gone;
  disk_.clear(gone);
  for (const BlockHash& h : gone) tier_deletes_.emplace_back(h.hi, h.lo);
  return true;
}

}  // namespace vpage
