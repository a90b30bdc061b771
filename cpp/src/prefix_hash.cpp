#include "vpage/prefix_hash.h"

namespace vpage {
namespace {

// Finaliser of a 64-bit mixing function: full avalanche of every input bit.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

inline uint64_t combine(uint64_t h, uint64_t v) {
  return mix64(h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2)));
}

}  // namespace

uint64_t hash_block(uint64_t parent_hash, const TokenId* tokens, int32_t num_tokens,
                    uint64_t extra_key) {
  uint64_t h = combine(mix64(parent_hash + 0x51ed270b27c1f3a5ULL), extra_key);
  for (int32_t i = 0; i < num_tokens; ++i) h = combine(h, static_cast<uint32_t>(tokens[i]));
  return combine(h, static_cast<uint64_t>(num_tokens));
}

uint64_t hash_cache_salt(const std::string& salt) {
  if (salt.empty()) return 0;
  uint64_t h = 0x6a09e667f3bcc908ULL;
  for (unsigned char c : salt) h = combine(h, c);
  return combine(h, salt.size());
}

}  // namespace vpage
