#include "block_pool.h"

#include <algorithm>

namespace vpage {

BlockPool::BlockPool(Device device, int32_t num_blocks, bool enable_caching, int32_t block_size)
    : device_(device), num_blocks_(num_blocks), caching_(enable_caching), block_size_(block_size) {
  VPAGE_CHECK(num_blocks >= 0, "number of blocks must be >= 0, got " << num_blocks);
  VPAGE_CHECK(!enable_caching || block_size > 0, "a caching pool needs block_size > 0, got " << block_size);
  const size_t n = static_cast<size_t>(num_blocks);
  refcount_.assign(n, 0);
  prev_.assign(n + 1, num_blocks);
  next_.assign(n + 1, num_blocks);
  cid_.assign(n, kNoContent);
  if (caching_) {
    hash_.assign(n, BlockHash{});
    parent_.assign(n, kNoContent);
    salt_.assign(n, std::string());
    tokens_.assign(n * static_cast<size_t>(block_size), 0);
  }
  for (BlockId b = 0; b < num_blocks; ++b) push_back(b);
}

size_t BlockPool::check_id(BlockId block) const {
  VPAGE_CHECK(block >= 0 && block < num_blocks_,
              "block id " << block << " out of range [0, " << num_blocks_ << ")");
  return static_cast<size_t>(block);
}

void BlockPool::unlink(BlockId block) {
  const int32_t p = prev_[block], n = next_[block];
  next_[p] = n;
  prev_[n] = p;
  prev_[block] = next_[block] = -1;
  --num_free_;
}

void BlockPool::push_back(BlockId block) {
  const int32_t sentinel = num_blocks_;
  const int32_t last = prev_[sentinel];
  prev_[block] = last;
  next_[block] = sentinel;
  next_[last] = block;
  prev_[sentinel] = block;
  ++num_free_;
}

void BlockPool::drop_hash(BlockId block) {
  if (cid_[block] == kNoContent) return;
  if (record_events_) {
    KvCacheEvent event;
    event.kind = KvCacheEvent::Kind::kRemoved;
    event.hash_hi = hash_[block].hi;
    event.hash_lo = hash_[block].lo;
    events_.push_back(std::move(event));
  }
  cached_.erase(hash_[block]);
  cid_[block] = kNoContent;
  salt_[block].clear();
}

bool BlockPool::reset_cache() {
  if (num_free_ != num_blocks_) return false;
  for (BlockId block = 0; block < num_blocks_; ++block) {
    cid_[block] = kNoContent;
    salt_[block].clear();
  }
  cached_.clear();
  if (record_events_ && caching_) {
    KvCacheEvent event;
    event.kind = KvCacheEvent::Kind::kAllCleared;
    events_.push_back(std::move(event));
  }
  return true;
}

bool BlockPool::drop_entry(BlockId block, const BlockHash& hash) {
  if (refcount_[check_id(block)] != 0 || cid_[block] == kNoContent || hash_[block] != hash) return false;
  drop_hash(block);
  return true;
}

void BlockPool::drop_free_entries() {
  for (BlockId block = 0; block < num_blocks_; ++block) {
    if (refcount_[block] == 0 && cid_[block] != kNoContent) {
      cached_.erase(hash_[block]);
      cid_[block] = kNoContent;
      salt_[block].clear();
    }
  }
}

std::vector<EvictedEntry> BlockPool::take_evicted() {
  std::vector<EvictedEntry> taken;
  taken.swap(evicted_);
  return taken;
}

bool BlockPool::same_content(BlockId block, const BlockContent& content) const {
  if (parent_[block] != content.parent) return false;
  if (content.parent == kFirstBlock && salt_[block] != (content.salt ? *content.salt : std::string())) {
    return false;
  }
  const TokenId* recorded = tokens_.data() + static_cast<size_t>(block) * block_size_;
  return std::equal(recorded, recorded + block_size_, content.tokens);
}

BlockId BlockPool::allocate() {
  VPAGE_CHECK(num_free_ > 0, "no free block in the " << (device_ == Device::kGpu ? "GPU" : "CPU")
                                                     << " pool");
  const BlockId block = next_[num_blocks_];
  unlink(block);
  if (cid_[block] != kNoContent) {
    if (keep_evicted_) {
      EvictedEntry entry;
      entry.block = block;
      entry.hash = hash_[block];
      entry.cid = cid_[block];
      entry.parent = parent_[block];
      entry.salt = salt_[block];
      const auto first = tokens_.begin() + static_cast<size_t>(block) * block_size_;
      entry.tokens.assign(first, first + block_size_);
      evicted_.push_back(std::move(entry));
    }
    drop_hash(block);
    ++stats_.evictions;
  }
  refcount_[block] = 1;
  return block;
}

void BlockPool::incref(BlockId block) {
  VPAGE_CHECK(refcount_[check_id(block)] > 0, "incref of free block " << block);
  ++refcount_[block];
}

void BlockPool::decref(BlockId block) {
  VPAGE_CHECK(refcount_[check_id(block)] > 0, "double free of block " << block);
  if (--refcount_[block] == 0) push_back(block);
}

BlockId BlockPool::lookup(const BlockHash& hash, const BlockContent& content, bool count) {
  if (!caching_ || content.parent == kNoContent) return -1;
  const auto it = cached_.find(hash);
  BlockId found = it == cached_.end() ? -1 : it->second;
  if (found >= 0 && !same_content(found, content)) {
    found = -1;
    if (count) ++stats_.collisions;
  }
  if (count) {
    ++stats_.queries;
    stats_.hits += found >= 0;
  }
  return found;
}

void BlockPool::acquire_cached(BlockId block) {
  VPAGE_CHECK(cid_[check_id(block)] != kNoContent, "block " << block << " is not a cached block");
  if (refcount_[block]++ == 0) unlink(block);
}

uint64_t BlockPool::register_block(BlockId block, const BlockHash& hash, const BlockContent& content,
                                   uint64_t cid) {
  VPAGE_CHECK(refcount_[check_id(block)] > 0, "register_block on free block " << block);
  if (!caching_ || content.parent == kNoContent) return kNoContent;
  if (cid_[block] != kNoContent) return cid_[block];
  const auto [it, inserted] = cached_.emplace(hash, block);
  if (!inserted) {
    if (same_content(it->second, content)) return cid_[it->second];
    ++stats_.collisions;
    return kNoContent;
  }
  hash_[block] = hash;
  cid_[block] = cid != kNoContent ? cid : (*next_cid_)++;
  parent_[block] = content.parent;
  if (content.parent == kFirstBlock && content.salt) salt_[block] = *content.salt;
  std::copy(content.tokens, content.tokens + block_size_, tokens_.begin() + static_cast<size_t>(block) * block_size_);
  return cid_[block];
}

void BlockPool::record_stored(BlockId block, const BlockHash& hash, const BlockHash* parent, int32_t lora_id) {
  if (!record_events_) return;
  KvCacheEvent event;
  event.hash_hi = hash.hi;
  event.hash_lo = hash.lo;
  if (parent != nullptr) {
    event.has_parent = true;
    event.parent_hi = parent->hi;
    event.parent_lo = parent->lo;
  }
  event.lora_id = lora_id;
  const auto first = tokens_.begin() + static_cast<size_t>(check_id(block)) * block_size_;
  event.token_ids.assign(first, first + block_size_);
  events_.push_back(std::move(event));
}

std::vector<KvCacheEvent> BlockPool::take_events() {
  std::vector<KvCacheEvent> taken;
  taken.swap(events_);
  return taken;
}

void BlockPool::check_invariants(const std::vector<int32_t>& expected_refcounts) const {
  VPAGE_CHECK(expected_refcounts.size() == refcount_.size(), "refcount table size mismatch");
  int32_t in_queue = 0;
  for (int32_t b = next_[num_blocks_]; b != num_blocks_; b = next_[b]) {
    VPAGE_CHECK(refcount_[b] == 0, "block " << b << " in the free queue has refcount "
                                            << refcount_[b]);
    VPAGE_CHECK(++in_queue <= num_blocks_, "free queue has a cycle");
  }
  VPAGE_CHECK(in_queue == num_free_, "free queue holds " << in_queue << " blocks, counter says "
                                                         << num_free_);
  int32_t zero = 0;
  for (int32_t b = 0; b < num_blocks_; ++b) {
    VPAGE_CHECK(refcount_[b] == expected_refcounts[b],
                "block " << b << " has refcount " << refcount_[b] << " but "
                         << expected_refcounts[b] << " block tables hold it");
    zero += refcount_[b] == 0;
  }
  VPAGE_CHECK(zero == num_free_, "free + used != total");
  size_t hashed = 0;
  for (int32_t b = 0; b < num_blocks_; ++b) {
    if (cid_[b] == kNoContent) continue;
    VPAGE_CHECK(caching_, "block " << b << " is cached in a pool without caching");
    ++hashed;
    const auto it = cached_.find(hash_[b]);
    VPAGE_CHECK(it != cached_.end() && it->second == b, "cache index misses block " << b);
  }
  VPAGE_CHECK(hashed == cached_.size(), "cache index has entries for unhashed blocks");
}

}  // namespace vpage
