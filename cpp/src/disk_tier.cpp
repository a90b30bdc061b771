#include "disk_tier.h"

#include <algorithm>

namespace vpage {

DiskTier::DiskTier(int32_t capacity, int32_t block_size) : capacity_(capacity), block_size_(block_size) {
  VPAGE_CHECK(capacity >= 0, "disk blocks must be >= 0, got " << capacity);
}

bool DiskTier::lookup(const BlockHash& hash, const TokenId* tokens, bool first, const std::string& salt,
                      bool count) {
  const auto it = index_.find(hash);
  bool hit = false;
  if (it != index_.end()) {
    const DiskRecord& r = *it->second;
    hit = r.first == first && (!first || r.salt == salt) && std::equal(r.tokens.begin(), r.tokens.end(), tokens);
    if (!hit && count) ++stats_.collisions;
    if (hit) lru_.splice(lru_.end(), lru_, it->second);
  }
  if (count) {
    ++stats_.queries;
    stats_.hits += hit;
  }
  return hit;
}

bool DiskTier::insert(DiskRecord record, std::vector<BlockHash>& evicted) {
  if (!enabled() || index_.count(record.hash)) return false;
  VPAGE_CHECK(static_cast<int32_t>(record.tokens.size()) == block_size_,
              "a disk record holds " << record.tokens.size() << " tokens, not block_size " << block_size_);
  while (static_cast<int32_t>(index_.size()) >= capacity_) {
    evicted.push_back(lru_.front().hash);
    index_.erase(lru_.front().hash);
    lru_.pop_front();
    ++stats_.evictions;
  }
  const BlockHash hash = record.hash;
  lru_.push_back(std::move(record));
  index_.emplace(hash, std::prev(lru_.end()));
  return true;
}

void DiskTier::erase(const BlockHash& hash) {
  const auto it = index_.find(hash);
  if (it == index_.end()) return;
  lru_.erase(it->second);
  index_.erase(it);
}

void DiskTier::clear(std::vector<BlockHash>& gone) {
  for (const DiskRecord& r : lru_) gone.push_back(r.hash);
  lru_.clear();
  index_.clear();
}

}  // namespace vpage
