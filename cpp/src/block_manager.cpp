#include "block_manager.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>


namespace vpage {

BlockManager::BlockManager(const BlockManagerConfig& config)
    : config_(config),
      gpu_(Device::kGpu, config.num_gpu_blocks, config.enable_prefix_caching, std::max(config.block_size, 1)),
      cpu_(Device::kCpu, config.num_cpu_blocks, false),
      hasher_(config.collide_prefix_hashes_for_testing) {
  VPAGE_CHECK(config.block_size > 0, "block_size must be > 0, got " << config.block_size);
  VPAGE_CHECK(config.watermark >= 0.0 && config.watermark < 1.0,
              "watermark must be in [0, 1), got " << config.watermark);
  watermark_blocks_ = static_cast<int32_t>(std::ceil(config.watermark * config.num_gpu_blocks));
}

int32_t BlockManager::blocks_for(int32_t num_tokens) const {
  return (num_tokens + config_.block_size - 1) / config_.block_size;
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

int32_t BlockManager::match_prefix(const SequenceGroup& group, Sequence& seq, bool acquire,
                                   int32_t* num_hits_free) {
  if (!gpu_.caching_enabled()) return 0;
  // The last token is always computed (its logits are needed).
  const int32_t cacheable = (seq.num_tokens() - 1) / config_.block_size;
  ensure_hashes(group, seq, cacheable);
  int32_t hits = 0;
  uint64_t parent = kFirstBlock;
  while (hits < cacheable) {
    const BlockId b = gpu_.lookup(seq.block_hashes_[hits], content_of(group, seq, hits, parent), acquire);
    if (b < 0) break;
    parent = gpu_.content_id(b);
    if (acquire) {
      gpu_.acquire_cached(b);
      seq.block_table_.push_back(b);
      seq.block_cids_.push_back(parent);
    } else if (num_hits_free) {
      *num_hits_free += gpu_.refcount(b) == 0;
    }
    ++hits;
  }
  return hits;
}

BlockManager::AdmissionPlan BlockManager::plan_admission(SequenceGroup& group) {
  const int32_t bs = config_.block_size;
  AdmissionPlan plan;
  Sequence* leader = nullptr;
  int32_t common = 0, min_len = 0, own_blocks = 0;
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
  plan.num_hits = match_prefix(group, *leader, false, &plan.num_hits_free);
  return plan;
}

AllocStatus BlockManager::can_allocate(SequenceGroup& group) {
  const AdmissionPlan plan = plan_admission(group);
  if (plan.num_total_blocks > gpu_.num_blocks() - watermark_blocks_) return AllocStatus::kNever;
  const int32_t needed = plan.num_total_blocks - plan.num_hits + plan.num_hits_free;
  if (gpu_.num_free() - needed < watermark_blocks_) return AllocStatus::kLater;
  return AllocStatus::kOk;
}

void BlockManager::allocate(SequenceGroup& group) {
  const int32_t bs = config_.block_size;
  const AdmissionPlan plan = plan_admission(group);
  VPAGE_CHECK(gpu_.num_free() >= plan.num_total_blocks - plan.num_hits + plan.num_hits_free,
              "not enough free GPU blocks to allocate group '" << group.request_id() << "'");
  const int32_t shared_blocks = blocks_for(plan.shared_len);
  Sequence* leader = nullptr;
  for (auto& s : group.seqs_) {
    if (is_finished(s->status())) continue;
    VPAGE_CHECK(s->block_table_.empty(), "sequence " << s->seq_id() << " already has blocks");
    s->block_device_ = Device::kGpu;
    auto& table = s->block_table_;
    if (!leader) {
      // The leader computes the shared blocks (after any prefix-cache hits) for everyone.
      leader = s.get();
      const int32_t hits = match_prefix(group, *s, true, nullptr);
      while (static_cast<int32_t>(table.size()) < blocks_for(s->num_tokens())) table.push_back(gpu_.allocate());
      s->num_computed_ = hits * bs;
      continue;
    }
    table.assign(leader->block_table_.begin(), leader->block_table_.begin() + shared_blocks);
    for (BlockId b : table) gpu_.incref(b);
    while (static_cast<int32_t>(table.size()) < blocks_for(s->num_tokens())) table.push_back(gpu_.allocate());
    s->num_computed_ = plan.identical ? leader->num_computed_ : plan.shared_len;
    // The leader registers the shared blocks; their content ids are read back when needed.
    s->block_cids_.assign(static_cast<size_t>(s->num_computed_ / bs), kNoContent);
    std::copy(leader->block_cids_.begin(), leader->block_cids_.begin() +
              std::min(leader->block_cids_.size(), s->block_cids_.size()), s->block_cids_.begin());
  }
  group.identical_ = plan.identical;
  group.shared_len_ = plan.identical ? 0 : plan.shared_len;
  group.num_cached_tokens_ = leader->num_computed_;
}

bool BlockManager::can_append_slots(const SequenceGroup& group) const {
  const int32_t bs = config_.block_size;
  int32_t needed = 0;
  for (const auto& s : group.seqs_) {
    if (is_finished(s->status())) continue;
    const int32_t have = static_cast<int32_t>(s->block_table_.size());
    const int32_t want = blocks_for(s->num_tokens());
    if (want > have) {
      needed += want - have;
    } else if (!group.identical_ && gpu_.refcount(s->block_table_[(s->num_tokens() - 1) / bs]) > 1) {
      ++needed;
    }
  }
  return needed <= gpu_.num_free();
}

void BlockManager::append_slots(SequenceGroup& group, std::vector<BlockPair>& copies) {
  const int32_t bs = config_.block_size;
  for (auto& s : group.seqs_) {
    if (is_finished(s->status())) continue;
    VPAGE_CHECK(s->block_device_ == Device::kGpu, "append_slots on a swapped sequence");
    auto& table = s->block_table_;
    while (static_cast<int32_t>(table.size()) < blocks_for(s->num_tokens())) {
      table.push_back(gpu_.allocate());
    }
    if (group.identical_) continue;
    BlockId& last = table[(s->num_tokens() - 1) / bs];
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
  for (BlockId b : parent.block_table_) p.incref(b);
  child.block_table_ = parent.block_table_;
  child.block_device_ = parent.block_device_;
  child.block_hashes_ = parent.block_hashes_;
  child.block_cids_ = parent.block_cids_;
}

void BlockManager::free(Sequence& seq) {
  BlockPool& p = pool(seq.block_device_);
  // Tail first: of one sequence's cached blocks, the end of the chain is evicted first.
  for (auto it = seq.block_table_.rbegin(); it != seq.block_table_.rend(); ++it) p.decref(*it);
  seq.block_table_.clear();
  seq.block_device_ = Device::kGpu;
}

int32_t BlockManager::num_distinct_blocks(const SequenceGroup& group) const {
  std::vector<BlockId> blocks;
  for (const auto& s : group.seqs_) {
    if (!is_finished(s->status())) blocks.insert(blocks.end(), s->block_table_.begin(), s->block_table_.end());
  }
  std::sort(blocks.begin(), blocks.end());
  return static_cast<int32_t>(std::unique(blocks.begin(), blocks.end()) - blocks.begin());
}

bool BlockManager::can_swap_out(const SequenceGroup& group) const {
  return num_distinct_blocks(group) <= cpu_.num_free();
}

AllocStatus BlockManager::can_swap_in(const SequenceGroup& group) const {
  const int32_t needed = num_distinct_blocks(group) + group.num_unfinished();
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
      auto it = moved.find(b);
      if (it == moved.end()) {
        it = moved.emplace(b, dst.allocate()).first;
        mapping.emplace_back(b, it->second);
      } else {
        dst.incref(it->second);
      }
      src.decref(b);
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
      if (cids[i - 1] == kNoContent) cids[i - 1] = gpu_.content_id(seq.block_table_[i - 1]);
      parent = cids[i - 1];
    }
    cids.push_back(gpu_.register_block(seq.block_table_[i], seq.block_hashes_[i], content_of(group, seq, i, parent)));
  }
}

BlockUsage BlockManager::usage() const {
  BlockUsage u;
  u.num_gpu_blocks = gpu_.num_blocks();
  u.free_gpu_blocks = gpu_.num_free();
  u.num_cpu_blocks = cpu_.num_blocks();
  u.free_cpu_blocks = cpu_.num_free();
  u.prefix_cache = gpu_.cache_stats();
  return u;
}

void BlockManager::check_invariants(const std::vector<const Sequence*>& seqs) const {
  std::vector<int32_t> gpu_refs(gpu_.num_blocks(), 0), cpu_refs(cpu_.num_blocks(), 0);
  for (const Sequence* s : seqs) {
    auto& refs = s->block_device_ == Device::kGpu ? gpu_refs : cpu_refs;
    VPAGE_CHECK(static_cast<int32_t>(s->block_table_.size()) >= blocks_for(s->num_computed_),
                "sequence " << s->seq_id() << " has computed tokens without blocks");
    for (BlockId b : s->block_table_) {
      VPAGE_CHECK(b >= 0 && b < static_cast<BlockId>(refs.size()),
                  "sequence " << s->seq_id() << " holds out-of-range block " << b);
      ++refs[b];
    }
  }
  gpu_.check_invariants(gpu_refs);
  cpu_.check_invariants(cpu_refs);
}

}  // namespace vpage
