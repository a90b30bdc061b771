// reshape_and_cache, copy_blocks, swap_blocks: data movement into and between KV cache
// blocks, multi-threaded on the kernel thread pool. Bit-exact, except that reshape_and_cache
// rounds float32 key/value rows to a 16-bit cache's dtype.
#include <algorithm>
#include <cstring>

#include "thread_pool.h"
#include "vpage/common.h"
#include "vpage/kernels/cpu_kernels.h"
#include "vpage/kernels/half.h"

namespace vpage::cpu {
namespace {

constexpr int64_t kTokensPerTask = 16;

void check_cache(const CacheShape& c, const char* op) {
  VPAGE_CHECK(c.dtype == DType::kFloat32 || c.dtype == DType::kFloat16 || c.dtype == DType::kBFloat16,
              op << ": unknown dtype code " << static_cast<int>(c.dtype));
  VPAGE_CHECK(c.num_blocks >= 0 && c.num_kv_heads > 0 && c.block_size > 0,
              op << ": num_blocks must be >= 0, num_kv_heads and block_size positive");
  VPAGE_CHECK(c.head_size > 0 && c.head_size % key_pack_size(c.dtype) == 0,
              op << ": head_size must be a positive multiple of " << key_pack_size(c.dtype));
}

int64_t block_bytes(const CacheShape& c) {
  return static_cast<int64_t>(c.num_kv_heads) * c.head_size * c.block_size * dtype_size(c.dtype);
}

// VPAGE_CHECK builds its message only on failure: this runs once per pair.
void check_pair(const int64_t* pair, int64_t src_blocks, int64_t dst_blocks, int64_t index, const char* op) {
  VPAGE_CHECK(pair[0] >= 0 && pair[0] < src_blocks && pair[1] >= 0 && pair[1] < dst_blocks,
              op << ": block_mapping[" << index << "] = (" << pair[0] << ", " << pair[1]
                 << ") out of range (source blocks " << src_blocks << ", destination blocks " << dst_blocks << ")");
}

// Elem is the cache's element and In the input's: a same-size stand-in for both when the
// dtypes match (bytes are copied), or float and uint16_t, converted by `convert`.
// Tokens are taken in runs of consecutive slots within one block (a prompt's tokens), so the
// writes of a run go to contiguous bytes: `run` key chunks side by side for each of the
// head_size / x chunk rows, `run` values side by side for each of the head_size value rows.
template <typename In, typename Elem, typename Convert>
void cache_tokens(const ReshapeAndCacheArgs& a, int64_t begin, int64_t end, Convert convert) {
  const CacheShape& c = a.cache;
  const int x = 16 / static_cast<int>(sizeof(Elem));
  const int64_t head_elems = static_cast<int64_t>(c.head_size) * c.block_size;
  const In* key = static_cast<const In*>(a.key);
  const In* value = static_cast<const In*>(a.value);
  Elem* key_cache = static_cast<Elem*>(a.key_cache);
  Elem* value_cache = static_cast<Elem*>(a.value_cache);
  for (int64_t t = begin; t < end;) {
    const int64_t slot = a.slot_mapping[t];
    if (slot < 0) {
      ++t;
      continue;
    }
    const int64_t block = slot / c.block_size;
    const int64_t offset = slot % c.block_size;
    int64_t run = 1;
    while (t + run < end && offset + run < c.block_size && a.slot_mapping[t + run] == slot + run) ++run;
    for (int32_t h = 0; h < c.num_kv_heads; ++h) {
      const In* k = key + t * a.key_stride + static_cast<int64_t>(h) * c.head_size;
      const In* v = value + t * a.value_stride + static_cast<int64_t>(h) * c.head_size;
      const int64_t head_base = (block * c.num_kv_heads + h) * head_elems;
      for (int32_t chunk = 0; chunk < c.head_size / x; ++chunk) {
        Elem* k_dst = key_cache + head_base + (static_cast<int64_t>(chunk) * c.block_size + offset) * x;
        for (int64_t r = 0; r < run; ++r) {
          for (int i = 0; i < x; ++i) k_dst[r * x + i] = convert(k[r * a.key_stride + chunk * x + i]);
        }
      }
      for (int32_t d = 0; d < c.head_size; ++d) {
        Elem* v_dst = value_cache + head_base + static_cast<int64_t>(d) * c.block_size + offset;
        for (int64_t r = 0; r < run; ++r) v_dst[r] = convert(v[r * a.value_stride + d]);
      }
    }
    t += run;
  }
}

}  // namespace

void reshape_and_cache(const ReshapeAndCacheArgs& a, int num_threads) {
  const char* op = "reshape_and_cache";
  VPAGE_CHECK(num_threads >= 1, op << ": num_threads must be >= 1");
  check_cache(a.cache, op);
  VPAGE_CHECK(kv_dtypes_supported(a.dtype, a.cache.dtype),
              op << ": key/value dtype code " << static_cast<int>(a.dtype) << " cannot be written to a cache of dtype code "
                 << static_cast<int>(a.cache.dtype) << " (same dtype, or float32 into a 16-bit cache)");
  VPAGE_CHECK(a.num_tokens >= 0, op << ": num_tokens must be >= 0");
  if (a.num_tokens == 0) return;
  const int64_t row = static_cast<int64_t>(a.cache.num_kv_heads) * a.cache.head_size;
  VPAGE_CHECK(a.key_stride >= row && a.value_stride >= row,
              op << ": key/value row stride must be >= num_kv_heads * head_size");
  VPAGE_CHECK(a.key && a.value && a.key_cache && a.value_cache && a.slot_mapping, op << ": null data pointer");
  const int64_t num_slots = a.cache.num_blocks * a.cache.block_size;
  for (int64_t t = 0; t < a.num_tokens; ++t) {
    VPAGE_CHECK(a.slot_mapping[t] < num_slots, op << ": slot_mapping[" << t << "] = " << a.slot_mapping[t]
                                                  << " >= num_blocks * block_size (" << num_slots << ")");
  }
  const int64_t tasks = (a.num_tokens + kTokensPerTask - 1) / kTokensPerTask;
  ThreadPool::instance().parallel_for(tasks, num_threads, [&](int64_t task, int) {
    const int64_t begin = task * kTokensPerTask;
    const int64_t end = std::min(a.num_tokens, begin + kTokensPerTask);
    const auto copy = [](auto bits) { return bits; };
    if (a.dtype != a.cache.dtype && a.cache.dtype == DType::kFloat16) {
      cache_tokens<float, uint16_t>(a, begin, end, float_to_half);
    } else if (a.dtype != a.cache.dtype) {
      cache_tokens<float, uint16_t>(a, begin, end, float_to_bfloat16);
    } else if (dtype_size(a.cache.dtype) == 4) {
      cache_tokens<uint32_t, uint32_t>(a, begin, end, copy);
    } else {
      cache_tokens<uint16_t, uint16_t>(a, begin, end, copy);
    }
  });
}

void copy_blocks(const CopyBlocksArgs& a, int num_threads) {
  const char* op = "copy_blocks";
  VPAGE_CHECK(num_threads >= 1, op << ": num_threads must be >= 1");
  check_cache(a.cache, op);
  VPAGE_CHECK(a.num_layers >= 0 && a.num_pairs >= 0, op << ": num_layers and num_pairs must be >= 0");
  if (a.num_layers == 0 || a.num_pairs == 0) return;
  VPAGE_CHECK(a.key_caches && a.value_caches && a.block_mapping, op << ": null data pointer");
  for (int32_t l = 0; l < a.num_layers; ++l) {
    VPAGE_CHECK(a.key_caches[l] && a.value_caches[l], op << ": null cache pointer of layer " << l);
  }
  for (int64_t i = 0; i < a.num_pairs; ++i) {
    check_pair(a.block_mapping + 2 * i, a.cache.num_blocks, a.cache.num_blocks, i, op);
  }
  const int64_t bytes = block_bytes(a.cache);
  ThreadPool::instance().parallel_for(a.num_layers * a.num_pairs, num_threads, [&](int64_t task, int) {
    const int64_t layer = task / a.num_pairs;
    const int64_t* pair = a.block_mapping + 2 * (task % a.num_pairs);
    for (void* cache : {a.key_caches[layer], a.value_caches[layer]}) {
      char* base = static_cast<char*>(cache);
      std::memmove(base + pair[1] * bytes, base + pair[0] * bytes, bytes);
    }
  });
}

void swap_blocks(const SwapBlocksArgs& a, int num_threads) {
  const char* op = "swap_blocks";
  VPAGE_CHECK(num_threads >= 1, op << ": num_threads must be >= 1");
  VPAGE_CHECK(a.block_bytes > 0 && a.num_pairs >= 0, op << ": block_bytes must be positive and num_pairs >= 0");
  if (a.num_pairs == 0) return;
  VPAGE_CHECK(a.src && a.dst && a.block_mapping, op << ": null data pointer");
  for (int64_t i = 0; i < a.num_pairs; ++i) {
    check_pair(a.block_mapping + 2 * i, a.src_num_blocks, a.dst_num_blocks, i, op);
  }
  ThreadPool::instance().parallel_for(a.num_pairs, num_threads, [&](int64_t task, int) {
    const int64_t* pair = a.block_mapping + 2 * task;
    std::memcpy(static_cast<char*>(a.dst) + pair[1] * a.block_bytes,
                static_cast<const char*>(a.src) + pair[0] * a.block_bytes, a.block_bytes);
  });
}

}  // namespace vpage::cpu
