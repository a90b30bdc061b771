#include "block_manager.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>


namespace vpage {

BlockManager::BlockManager(const BlockManagerConfig& config, int32_t max_step_tokens)
    : config_(config),
      gpu_(Device::kGpu, config.num_gpu_blocks, config.enable_prefix_caching, std::max(config.block_size, 1)),
      cpu_(Device::kCpu, config.num_cpu_blocks,
           config.enable_kv_offload && config.enable_prefix_caching && config.sliding_window == 0,
           std::max(config.block_size, 1)),
      disk_(config.enable_kv_offload && config.enable_prefix_caching && config.sliding_window == 0
                ? config.num_disk_blocks : 0,
            std::max(config.block_size, 1)),
      hasher_(config.collide_prefix_hashes_for_testing, config.prefix_hash_key0, config.prefix_hash_key1),
      max_step_tokens_(max_step_tokens) {
  gpu_.set_record_events(config.enable_kv_cache_events && config.enable_prefix_caching);
  VPAGE_CHECK(config.num_disk_blocks == 0 || config.enable_kv_offload,
              "a disk tier (num_disk_blocks) needs the CPU tier (enable_kv_offload)");
  cpu_.share_content_ids(gpu_);
  gpu_.set_keep_evicted(offloads());
  cpu_.set_keep_evicted(disk_.enabled());
  VPAGE_CHECK(config.block_size > 0, "block_size must be > 0, got " << config.block_size);
  VPAGE_CHECK(config.watermark >= 0.0 && config.watermark < 1.0,
              "watermark must be in [0, 1), got " << config.watermark);
  VPAGE_CHECK(config.sliding_window >= 0, "sliding_window must be >= 0, got " << config.sliding_window);
  VPAGE_CHECK(max_step_tokens > 0, "max_step_tokens must be > 0, got " << max_step_tokens);
  watermark_blocks_ = static_cast<int32_t>(std::ceil(config.watermark * config.num_gpu_blocks));
  const int64_t span = int64_t{config.sliding_window} - 1 + max_step_tokens;
  max_window_blocks_ = windowed() ? static_cast<int32_t>(std::min<int64_t>(
                                        (span + config.block_size - 1) / config.block_size + 1, INT32_MAX))
                                  : 0;
}

int32_t BlockManager::blocks_for(int32_t num_tokens) const {
  return (num_tokens + config_.block_size - 1) / config_.block_size;
}

int32_t BlockManager::blocks_needed(int32_t num_tokens, int32_t num_computed) const {
  if (!windowed()) return blocks_for(num_tokens);
  return blocks_for(static_cast<int32_t>(std::min<int64_t>(num_tokens, int64_t{num_computed} + max_step_tokens_)));
}

int32_t BlockManager::blocks_to_grow(const SequenceGroup& group) const {
  int32_t n = 0;
  for (const auto& s : group.seqs_) {
    if (is_finished(s->status()) || waits_for_prefix(group, *s)) continue;
    n += std::max(0, blocks_needed(*s) - static_cast<int32_t>(s->block_table_.size()));
    if (group.identical_) break;  // the others share the first one's table
  }
  return n;
}

BlockHash BlockManager::hash_salt(const std::string& salt) const { return hasher_.hash_salt(salt); }

void BlockManager::ensure_hashes(const SequenceGroup& group, Sequence& seq, int32_t num_blocks) {
  const int32_t bs = config_.block_size;
  auto& hashes = seq.block_hashes_;
  while (static_cast<int32_t>(hashes.size()) < num_blocks) {
    const size_t i = hashes.size();
    const BlockHash parent = i == 0 ? BlockHash{} : hashes[i - 1];
    hashes.push_back(hasher_.hash_block(parent, group.cache_salt_hash_, seq.tokens_.data() + i * bs, bs));
  }
}

BlockContent BlockManager::content_of(const SequenceGroup& group, const Sequence& seq, int32_t index,
                                      uint64_t parent) const {
  BlockContent content;
  content.tokens = seq.tokens_.data() + static_cast<size_t>(index) * config_.block_size;
  content.parent = parent;
  content.salt = &group.cache_salt_;
  return content;
}

int32_t BlockManager::match_prefix(const SequenceGroup& group, Sequence& seq, bool acquire, int32_t skip) {
  if (!acquire) hit_blocks_.clear();
  if (!gpu_.caching_enabled()) return 0;
  // The last token is always computed (its logits are needed).
  const int32_t cacheable = (seq.num_tokens() - 1) / config_.block_size;
  ensure_hashes(group, seq, cacheable);
  int32_t hits = 0;
  uint64_t parent = kFirstBlock;
  int32_t looked_up = 0;
  while (hits < cacheable) {
    const BlockHash& hash = seq.block_hashes_[hits];
    const BlockContent content = content_of(group, seq, hits, parent);
    const BlockId b = gpu_.lookup(hash, content, acquire);
    ++looked_up;
    if (b < 0) {
      if (!acquire || !offloads()) break;
      // The CPU tier: the block is swapped into a new GPU block before the forward.
      // (Not a block a disk load still fills: that load may yet fail.)
      const BlockId c = cpu_.lookup(hash, content, true);
      if (c < 0 || is_loading(c)) break;
      parent = cpu_.content_id(c);
      hold_cpu(c);
      const BlockId g = gpu_.allocate();
      tier_swap_in_.emplace_back(c, g);
      const uint64_t cid = gpu_.register_block(g, hash, content, parent);
      if (cid == parent) gpu_.record_stored(g, hash, hits > 0 ? &seq.block_hashes_[hits - 1] : nullptr, group.lora_id());
      seq.block_table_.push_back(g);
      seq.block_cids_.push_back(parent);
      ++hits;
      continue;
    }
    parent = gpu_.content_id(b);
    if (acquire) {
      // A hit before the window is not held: only its content id is kept, for the chain.
      const bool held = hits >= skip;
      if (held) gpu_.acquire_cached(b);
      seq.block_table_.push_back(held ? b : -1);
      seq.block_cids_.push_back(parent);
    } else {
      hit_blocks_.push_back(b);
    }
    ++hits;
  }
  // At admission every full block before the last token is a query, as vLLM counts a prompt's
  // tokens: the blocks after a chain's first miss miss without a lookup.
  if (acquire) gpu_.count_misses(cacheable - looked_up);
  return hits;
}

BlockManager::AdmissionPlan BlockManager::plan_admission(SequenceGroup& group) {
  const int32_t bs = config_.block_size;
  AdmissionPlan plan;
  Sequence* leader = nullptr;
  int32_t common = 0, min_len = 0, own_blocks = 0, window_blocks = 0;
  for (auto& s : group.seqs_) {
    if (is_finished(s->status())) continue;
    if (!leader) {
      leader = s.get();
      common = min_len = s->num_tokens();
    }
    const auto& a = leader->tokens_;
    const auto& b = s->tokens_;
    int32_t k = 0;
    const int32_t limit = std::min<int32_t>(common, s->num_tokens());
    while (k < limit && a[k] == b[k]) ++k;
    common = k;
    min_len = std::min(min_len, s->num_tokens());
    plan.identical = plan.identical && a.size() == b.size() && k == s->num_tokens();
    own_blocks += blocks_for(s->num_tokens());
    window_blocks += std::min(blocks_for(s->num_tokens()), max_window_blocks_);
  }
  VPAGE_CHECK(leader != nullptr, "group '" << group.request_id() << "' has no unfinished sequence");
  if (plan.identical) {
    plan.shared_len = leader->num_tokens();
    plan.num_total_blocks = blocks_for(plan.shared_len);
  } else {
    // Full blocks of the common prefix that leave every sequence a token of its own.
    plan.shared_len = std::min(common, min_len - 1) / bs * bs;
    const int32_t shared_blocks = plan.shared_len / bs;
    plan.num_total_blocks = own_blocks - (group.num_unfinished() - 1) * shared_blocks;
  }
  const int32_t hits = match_prefix(group, *leader, false, 0);
  if (!windowed()) {
    plan.num_hits = hits;
    for (BlockId b : hit_blocks_) plan.num_hits_free += gpu_.refcount(b) == 0;
    plan.num_new_blocks = plan.num_total_blocks - hits;
    return plan;
  }
  // With a window the first sequence holds the hits inside its window and the blocks of its
  // next step. Diverged ones wait, holding nothing, while it computes their shared prefix;
  // when the prefix cache holds that prefix they take its blocks inside their window at once.
  const int32_t shared_blocks = plan.identical ? 0 : plan.shared_len / bs;
  plan.num_skipped = first_window_block(hits * bs);
  plan.prefix_pending = hits < shared_blocks;
  if (!plan.prefix_pending) {
    plan.shared_from = first_window_block(plan.shared_len);
    plan.shared_to = shared_blocks;
  }
  const bool shares = plan.shared_from < plan.shared_to;
  for (int32_t i = shares ? std::min(plan.shared_from, plan.num_skipped) : plan.num_skipped; i < hits; ++i) {
    if (i < plan.num_skipped && !(i >= plan.shared_from && i < plan.shared_to)) continue;
    ++plan.num_hits;
    plan.num_hits_free += gpu_.refcount(hit_blocks_[i]) == 0;
  }
  plan.num_new_blocks = blocks_needed(leader->num_tokens(), hits * bs) - hits;
  if (!plan.identical && !plan.prefix_pending) {
    for (const auto& s : group.seqs_) {
      if (is_finished(s->status()) || s.get() == leader) continue;
      plan.num_new_blocks += blocks_needed(s->num_tokens(), plan.shared_len) - shared_blocks;
    }
  }
  plan.num_total_blocks = std::min(plan.num_total_blocks, plan.identical ? max_window_blocks_ : window_blocks);
  return plan;
}

AllocStatus BlockManager::can_allocate(SequenceGroup& group) {
  const AdmissionPlan plan = plan_admission(group);
  if (plan.num_total_blocks > gpu_.num_blocks() - watermark_blocks_) return AllocStatus::kNever;
  // Room for all the group will hold (less the hits it holds), and at least for what it takes now.
  const int32_t needed = std::max(plan.num_total_blocks - plan.num_hits, plan.num_new_blocks) + plan.num_hits_free;
  if (gpu_.num_free() - needed < watermark_blocks_) return AllocStatus::kLater;
  return AllocStatus::kOk;
}

void BlockManager::allocate(SequenceGroup& group) {
  const int32_t bs = config_.block_size;
  const AdmissionPlan plan = plan_admission(group);
  VPAGE_CHECK(gpu_.num_free() >= plan.num_new_blocks + plan.num_hits_free,
              "not enough free GPU blocks to allocate group '" << group.request_id() << "'");
  const bool window_share = windowed() && !plan.identical && !plan.prefix_pending;
  // Hits first (blocks taken before any allocation can evict the cached ones).
  Sequence* leader = nullptr;
  for (auto& s : group.seqs_) {
    if (is_finished(s->status())) continue;
    VPAGE_CHECK(s->block_table_.empty(), "sequence " << s->seq_id() << " already has blocks");
    s->block_device_ = Device::kGpu;
    if (!leader) {
      // The leader computes the shared blocks (after any prefix-cache hits) for everyone.
      leader = s.get();
      s->num_computed_ = match_prefix(group, *s, true, plan.num_skipped) * bs;
    } else if (window_share) {
      // The cached blocks of the shared prefix inside this sequence's window.
      s->block_table_.assign(static_cast<size_t>(plan.shared_from), -1);
      for (int32_t i = plan.shared_from; i < plan.shared_to; ++i) {
        gpu_.acquire_cached(hit_blocks_[i]);
        s->block_table_.push_back(hit_blocks_[i]);
      }
    }
  }
  auto& leader_table = leader->block_table_;
  while (static_cast<int32_t>(leader_table.size()) < blocks_needed(*leader)) leader_table.push_back(gpu_.allocate());
  const size_t shared_blocks = std::min<size_t>(blocks_for(plan.shared_len), leader_table.size());
  for (auto& s : group.seqs_) {
    if (is_finished(s->status()) || s.get() == leader) continue;
    if (windowed() && plan.prefix_pending) continue;  // waits_for_prefix() until the leader is there
    auto& table = s->block_table_;
    if (!window_share) {
      table.assign(leader_table.begin(), leader_table.begin() + shared_blocks);
      for (BlockId b : table) {
        if (b >= 0) gpu_.incref(b);
      }
    }
    s->num_computed_ = plan.identical ? leader->num_computed_ : plan.shared_len;
    while (static_cast<int32_t>(table.size()) < blocks_needed(*s)) table.push_back(gpu_.allocate());
    // The leader registers the shared blocks; their content ids are read back when needed.
    s->block_cids_.assign(static_cast<size_t>(s->num_computed_ / bs), kNoContent);
    std::copy(leader->block_cids_.begin(), leader->block_cids_.begin() +
              std::min(leader->block_cids_.size(), s->block_cids_.size()), s->block_cids_.begin());
  }
  group.identical_ = plan.identical;
  group.disk_fetched_ = false;
  group.shared_len_ = plan.identical ? 0 : plan.shared_len;
  group.num_cached_tokens_ = leader->num_computed_;
}

bool BlockManager::can_append_slots(const SequenceGroup& group) const {
  const int32_t bs = config_.block_size;
  int32_t needed = 0;
  for (const auto& s : group.seqs_) {
    if (is_finished(s->status()) || waits_for_prefix(group, *s)) continue;
    const int32_t have = static_cast<int32_t>(s->block_table_.size());
    const int32_t want = blocks_needed(*s);
    const int32_t last = (s->num_tokens() - 1) / bs;
    needed += std::max(0, want - have);
    // The last token's block is copied when shared (with draft tokens the table can grow too).
    if (!group.identical_ && last < have && gpu_.refcount(s->block_table_[last]) > 1) ++needed;
    if (group.identical_) break;  // the others share the first one's table
  }
  return needed <= gpu_.num_free();
}

void BlockManager::append_slots(SequenceGroup& group, std::vector<BlockPair>& copies) {
  const int32_t bs = config_.block_size;
  const Sequence* first = nullptr;
  for (auto& s : group.seqs_) {
    if (is_finished(s->status()) || waits_for_prefix(group, *s)) continue;
    VPAGE_CHECK(s->block_device_ == Device::kGpu, "append_slots on a swapped sequence");
    auto& table = s->block_table_;
    if (group.identical_ && first) {
      // One prompt computed once for all: the others' tables follow the first one's.
      while (table.size() < first->block_table_.size()) {
        const BlockId b = first->block_table_[table.size()];
        gpu_.incref(b);
        table.push_back(b);
      }
      continue;
    }
    first = s.get();
    while (static_cast<int32_t>(table.size()) < blocks_needed(*s)) table.push_back(gpu_.allocate());
    if (group.identical_) continue;
    // The block the last token goes to; a windowed prefill may not have reached it yet.
    const size_t index = static_cast<size_t>((s->num_tokens() - 1) / bs);
    if (index >= table.size()) continue;
    BlockId& last = table[index];
    if (gpu_.refcount(last) > 1) {
      const BlockId copy = gpu_.allocate();
      copies.emplace_back(last, copy);
      gpu_.decref(last);
      last = copy;
    }
  }
}

void BlockManager::fork(const Sequence& parent, Sequence& child) {
  VPAGE_CHECK(child.block_table_.empty(), "fork target " << child.seq_id() << " already has blocks");
  BlockPool& p = pool(parent.block_device_);
  for (BlockId b : parent.block_table_) {
    if (b >= 0) p.incref(b);
  }
  child.block_table_ = parent.block_table_;
  child.block_device_ = parent.block_device_;
  child.block_hashes_ = parent.block_hashes_;
  child.block_cids_ = parent.block_cids_;
}

void BlockManager::free(Sequence& seq) {
  BlockPool& p = pool(seq.block_device_);
  // Tail first: of one sequence's cached blocks, the end of the chain is evicted first.
  for (auto it = seq.block_table_.rbegin(); it != seq.block_table_.rend(); ++it) {
    if (*it >= 0) p.decref(*it);
  }
  seq.block_table_.clear();
  seq.block_device_ = Device::kGpu;
}

void BlockManager::free_lookahead(Sequence& seq) {
  auto& table = seq.block_table_;
  const size_t keep = static_cast<size_t>(blocks_for(seq.num_tokens()));
  BlockPool& p = pool(seq.block_device_);
  while (table.size() > keep) {
    p.decref(table.back());
    table.pop_back();
  }
}

void BlockManager::release_out_of_window(Sequence& seq) {
  if (!windowed()) return;
  auto& table = seq.block_table_;
  BlockPool& p = pool(seq.block_device_);
  // The entries before the window are -1 from the front: only the newly passed ones are visited,
  // the latest first (as free() does).
  const int32_t first = std::min(first_window_block(seq.num_computed_), static_cast<int32_t>(table.size()));
  for (int32_t i = first - 1; i >= 0 && table[i] >= 0; --i) {
    p.decref(table[i]);
    table[i] = -1;
  }
}

void BlockManager::share_computed_prefix(SequenceGroup& group) {
  const int32_t bs = config_.block_size;
  Sequence* leader = nullptr;
  for (auto& s : group.seqs_) {
    if (is_finished(s->status())) continue;
    if (!leader) {
      leader = s.get();
      if (group.shared_len_ == 0 || leader->num_computed_ < group.shared_len_) return;
      continue;
    }
    if (!waits_for_prefix(group, *s)) continue;
    const int32_t shared_blocks = group.shared_len_ / bs;
    const int32_t from = first_window_block(group.shared_len_);
    BlockPool& p = pool(leader->block_device_);
    auto& table = s->block_table_;
    table.assign(static_cast<size_t>(from), -1);
    for (int32_t i = from; i < shared_blocks; ++i) {
      const BlockId b = leader->block_table_[i];
      p.incref(b);
      table.push_back(b);
    }
    s->block_device_ = leader->block_device_;
    s->num_computed_ = group.shared_len_;
    s->block_cids_.assign(static_cast<size_t>(shared_blocks), kNoContent);
    std::copy(leader->block_cids_.begin(), leader->block_cids_.begin() +
              std::min(leader->block_cids_.size(), s->block_cids_.size()), s->block_cids_.begin());
  }
  if (leader) group.shared_len_ = 0;
}

int32_t BlockManager::num_distinct_blocks(const SequenceGroup& group) const {
  std::vector<BlockId> blocks;
  for (const auto& s : group.seqs_) {
    if (is_finished(s->status())) continue;
    for (BlockId b : s->block_table_) {
      if (b >= 0) blocks.push_back(b);
    }
  }
  std::sort(blocks.begin(), blocks.end());
  return static_cast<int32_t>(std::unique(blocks.begin(), blocks.end()) - blocks.begin());
}

bool BlockManager::can_swap_out(const SequenceGroup& group) const {
  return num_distinct_blocks(group) <= cpu_.num_free();
}

AllocStatus BlockManager::can_swap_in(const SequenceGroup& group) const {
  int32_t needed = num_distinct_blocks(group) + group.num_unfinished();
  if (windowed()) needed += blocks_to_grow(group);  // append_slots follows at once
  if (needed > gpu_.num_blocks() - watermark_blocks_) return AllocStatus::kNever;
  if (gpu_.num_free() - needed < watermark_blocks_) return AllocStatus::kLater;
  return AllocStatus::kOk;
}

void BlockManager::move_group(SequenceGroup& group, Device to, std::vector<BlockPair>& mapping) {
  const Device from = to == Device::kGpu ? Device::kCpu : Device::kGpu;
  BlockPool& src = pool(from);
  BlockPool& dst = pool(to);
  std::unordered_map<BlockId, BlockId> moved;
  for (auto& s : group.seqs_) {
    if (is_finished(s->status())) continue;
    VPAGE_CHECK(s->block_device_ == from, "sequence " << s->seq_id() << " is not in the source pool");
    for (BlockId& b : s->block_table_) {
      if (b < 0) continue;  // before the window: stays -1
      auto it = moved.find(b);
      if (it == moved.end()) {
        it = moved.emplace(b, dst.allocate()).first;
        mapping.emplace_back(b, it->second);
      } else {
        dst.incref(it->second);
      }
      // A swap-in's source stays held until finish_step: this step's offload copies and disk
      // loads, which write CPU blocks before swap-ins read them, must not take it.
      if (to == Device::kGpu && offloads()) {
        swapped_in_cpu_.push_back(b);
      } else {
        src.decref(b);
      }
      b = it->second;
    }
    s->block_device_ = to;
  }
}

void BlockManager::swap_out(SequenceGroup& group, std::vector<BlockPair>& mapping) {
  VPAGE_CHECK(can_swap_out(group), "not enough CPU blocks to swap out '" << group.request_id() << "'");
  move_group(group, Device::kCpu, mapping);
}

void BlockManager::swap_in(SequenceGroup& group, std::vector<BlockPair>& mapping) {
  VPAGE_CHECK(num_distinct_blocks(group) <= gpu_.num_free(),
              "not enough GPU blocks to swap in '" << group.request_id() << "'");
  move_group(group, Device::kGpu, mapping);
}

void BlockManager::register_computed_blocks(const SequenceGroup& group, Sequence& seq) {
  if (!gpu_.caching_enabled() || seq.block_device_ != Device::kGpu) return;
  const int32_t full = seq.num_computed_ / config_.block_size;
  auto& cids = seq.block_cids_;
  if (full <= static_cast<int32_t>(cids.size())) return;
  ensure_hashes(group, seq, full);
  for (int32_t i = static_cast<int32_t>(cids.size()); i < full; ++i) {
    uint64_t parent = kFirstBlock;
    if (i > 0) {
      // A shared block computed by another sequence of the group: its entry, if any.
      // (None when that block has left the window already.)
      if (cids[i - 1] == kNoContent && seq.block_table_[i - 1] >= 0) {
        cids[i - 1] = gpu_.content_id(seq.block_table_[i - 1]);
      }
      parent = cids[i - 1];
    }
    const BlockId block = seq.block_table_[i];
    const bool was_cached = gpu_.content_id(block) != kNoContent;
    cids.push_back(gpu_.register_block(block, seq.block_hashes_[i], content_of(group, seq, i, parent)));
    if (!was_cached && cids.back() != kNoContent && cids.back() == gpu_.content_id(block)) {  // a new entry
      gpu_.record_stored(block, seq.block_hashes_[i], i > 0 ? &seq.block_hashes_[i - 1] : nullptr, group.lora_id());
    }
  }
}

BlockUsage BlockManager::usage() const {
  BlockUsage u;
  u.num_gpu_blocks = gpu_.num_blocks();
  u.free_gpu_blocks = gpu_.num_free();
  u.num_cpu_blocks = cpu_.num_blocks();
  u.free_cpu_blocks = cpu_.num_free();
  u.prefix_cache = gpu_.cache_stats();
  u.cpu_prefix_cache = cpu_.cache_stats();
  u.disk_prefix_cache = disk_.stats();
  u.num_disk_blocks = disk_.enabled() ? config_.num_disk_blocks : 0;
  u.used_disk_blocks = disk_.size();
  return u;
}

void BlockManager::check_invariants(const std::vector<const Sequence*>& seqs) const {
  std::vector<int32_t> gpu_refs(gpu_.num_blocks(), 0), cpu_refs(cpu_.num_blocks(), 0);
  for (const Sequence* s : seqs) {
    auto& refs = s->block_device_ == Device::kGpu ? gpu_refs : cpu_refs;
    VPAGE_CHECK(static_cast<int32_t>(s->block_table_.size()) >= blocks_for(s->num_computed_),
                "sequence " << s->seq_id() << " has computed tokens without blocks");
    // With a window the entries before it are -1 (released) and only those.
    const size_t first = static_cast<size_t>(first_window_block(s->num_computed_));
    for (size_t i = 0; i < s->block_table_.size(); ++i) {
      const BlockId b = s->block_table_[i];
      if (i < first) {
        VPAGE_CHECK(b == -1, "sequence " << s->seq_id() << " holds block " << b << " at " << i
                                         << ", before its window (first block " << first << ")");
        continue;
      }
      VPAGE_CHECK(b >= 0 && b < static_cast<BlockId>(refs.size()),
                  "sequence " << s->seq_id() << " holds out-of-range block " << b << " at " << i);
      ++refs[b];
    }
  }
  for (const KvBlockLoad& load : loading_) ++cpu_refs[load.cpu_block];  // held while the disk fills it
  gpu_.check_invariants(gpu_refs);
  cpu_.check_invariants(cpu_refs);
}

}  // namespace vpage
