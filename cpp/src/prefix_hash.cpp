#include "prefix_hash.h"

#include <cstring>
#include <random>
#include <vector>

namespace vpage {
namespace {

inline uint64_t rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

struct SipState {
  uint64_t v0, v1, v2, v3;
  void round() {
    v0 += v1; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32);
    v2 += v3; v3 = rotl(v3, 16); v3 ^= v2;
    v0 += v3; v3 = rotl(v3, 21); v3 ^= v0;
    v2 += v1; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32);
  }
};

inline uint64_t load_le64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// The process-wide key: drawn once, on first use.
const std::pair<uint64_t, uint64_t>& process_key() {
  static const std::pair<uint64_t, uint64_t> key = [] {
    std::random_device rd;
    const auto draw = [&rd] { return (static_cast<uint64_t>(rd()) << 32) ^ rd(); };
    const uint64_t k0 = draw();
    return std::make_pair(k0, draw());
  }();
  return key;
}

// SipHash-c-d with a 128-bit output: c rounds per 8-byte word, d finalization rounds.
template <int C, int D>
BlockHash siphash(uint64_t k0, uint64_t k1, const void* data, size_t len) {
  const auto* in = static_cast<const unsigned char*>(data);
  SipState s{k0 ^ 0x736f6d6570736575ULL, k1 ^ 0x646f72616e646f6dULL ^ 0xee,
             k0 ^ 0x6c7967656e657261ULL, k1 ^ 0x7465646279746573ULL};
  const auto absorb = [&s](uint64_t m) {
    s.v3 ^= m;
    for (int i = 0; i < C; ++i) s.round();
    s.v0 ^= m;
  };
  const size_t full = len / 8 * 8;
  for (size_t i = 0; i < full; i += 8) absorb(load_le64(in + i));
  uint64_t last = static_cast<uint64_t>(len & 0xff) << 56;
  for (size_t i = full; i < len; ++i) last |= static_cast<uint64_t>(in[i]) << (8 * (i - full));
  absorb(last);
  s.v2 ^= 0xee;
  for (int i = 0; i < D; ++i) s.round();
  BlockHash h;
  h.lo = s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
  s.v1 ^= 0xdd;
  for (int i = 0; i < D; ++i) s.round();
  h.hi = s.v0 ^ s.v1 ^ s.v2 ^ s.v3;
  return h;
}

}  // namespace

BlockHash siphash128(uint64_t k0, uint64_t k1, const void* data, size_t len) {
  return siphash<2, 4>(k0, k1, data, len);
}

PrefixHasher::PrefixHasher(bool collide_for_testing, uint64_t k0, uint64_t k1)
    : k0_(k0 | k1 ? k0 : process_key().first), k1_(k0 | k1 ? k1 : process_key().second),
      collide_(collide_for_testing) {}

BlockHash PrefixHasher::hash_block(const BlockHash& parent, const BlockHash& salt,
                                   const TokenId* tokens, int32_t num_tokens) const {
  if (collide_) return BlockHash{1, 1};
  // Message: the chain value (the parent's hash; for a first block the salt's hash, which
  // later blocks inherit through it), then the token ids. Small blocks stay on the stack.
  const BlockHash& chain = parent == BlockHash{} ? salt : parent;
  constexpr size_t kHeader = 2 * sizeof(uint64_t);
  const size_t len = kHeader + sizeof(TokenId) * static_cast<size_t>(num_tokens);
  unsigned char stack[kHeader + sizeof(TokenId) * 64];
  std::vector<unsigned char> heap;
  unsigned char* buf = stack;
  if (len > sizeof(stack)) {
    heap.resize(len);
    buf = heap.data();
  }
  const uint64_t header[2] = {chain.lo, chain.hi};
  std::memcpy(buf, header, kHeader);
  std::memcpy(buf + kHeader, tokens, len - kHeader);
  return siphash<1, 3>(k0_, k1_, buf, len);
}

BlockHash PrefixHasher::hash_salt(const std::string& salt) const {
  if (salt.empty()) return BlockHash{};
  return siphash<2, 4>(k0_, k1_, salt.data(), salt.size());
}

}  // namespace vpage
