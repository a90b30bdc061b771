// Float lanes and token bitmask words as lane masks, for the row loops of sampler_ops.cpp and
// token_bitmask.cpp (GNU vectors: GCC and Clang compile them for every target clone).
#pragma once

#include <cstdint>

namespace vpage::cpu {

// Eight float lanes as a GNU vector. The select `a > b ? a : b` on it compiles to maxps in
// every clone; written over an array of lanes GCC 12 left it scalar, one maxss per value
// (logsumexp_argmax over [256, 49152] logits, 2 threads, Zen 3: 8.5 -> 7.7 ms median of 6
// alternating runs; one row 75 -> 62 us).
typedef float Lanes8 __attribute__((vector_size(32)));
typedef int32_t Mask8 __attribute__((vector_size(32)));  // their masks: -1 (true) or 0

/// kLaneBits[k][l] = bit 8 k + l of a bitmask word: `(word_lanes & bits_k) != 0` is the mask of
/// tokens [8 k, 8 k + 8) of that word, with word_lanes the word in every lane.
alignas(32) inline constexpr int32_t kLaneBits[4][8] = {
    {1 << 0, 1 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 5, 1 << 6, 1 << 7},
    {1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12, 1 << 13, 1 << 14, 1 << 15},
    {1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22, 1 << 23},
    {1 << 24, 1 << 25, 1 << 26, 1 << 27, 1 << 28, 1 << 29, 1 << 30, INT32_MIN},
};

/// True when the bitmask `words` allows every token of [0, vocab) (bits past vocab ignored).
inline bool allows_all(const int32_t* words, int64_t vocab) {
  const int64_t full = vocab / 32;
  int32_t all = -1;
  for (int64_t w = 0; w < full; ++w) all &= words[w];
  if (all != -1) return false;
  const int64_t rest = vocab % 32;
  const uint32_t tail_bits = (uint32_t{1} << rest) - 1;
  return rest == 0 || (static_cast<uint32_t>(words[full]) & tail_bits) == tail_bits;
}

}  // namespace vpage::cpu
