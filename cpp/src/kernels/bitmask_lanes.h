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

/// *lanes = the masks of tokens [8 k, 8 k + 8) of a bitmask word (k in [0, 4)): -1 where the
/// token's bit is set. (An out-parameter: a vector return value would change with the ABI of
/// the clone that inlines it.)
inline void allowed_lanes(uint32_t word, int k, Mask8* lanes) {
  const Mask8 bits = {1, 2, 4, 8, 16, 32, 64, 128};
  const Mask8 byte = Mask8{} + static_cast<int32_t>((word >> (8 * k)) & 0xffu);
  *lanes = (byte & bits) != 0;
}

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
