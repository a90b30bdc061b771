// copy_blocks: copy-on-write block copies for every layer in one launch.
//
// Grid and threads: blockIdx.x = pair, blockIdx.y = layer; 256 threads copy the pair's
// key block and value block of that layer in 16-byte words (a block is
// num_kv_heads * head_size * block_size elements, always a multiple of 16 bytes).
#include "vpage/cuda/cache_ops.h"

#include <cstdint>

namespace vpage::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridY = 65535;

__global__ void __launch_bounds__(kThreads) copy_blocks_kernel(const CopyBlocksArgs a, int64_t block_words) {
  const int64_t pair = blockIdx.x;
  const int layer = blockIdx.y;
  const int64_t src = a.block_mapping[2 * pair] * block_words;
  const int64_t dst = a.block_mapping[2 * pair + 1] * block_words;
  uint4* key_cache = static_cast<uint4*>(a.key_caches[layer]);
  uint4* value_cache = static_cast<uint4*>(a.value_caches[layer]);
  for (int64_t i = threadIdx.x; i < block_words; i += kThreads) {
    key_cache[dst + i] = key_cache[src + i];
    value_cache[dst + i] = value_cache[src + i];
  }
}

}  // namespace

cudaError_t copy_blocks(const CopyBlocksArgs& args, cudaStream_t stream) {
  const int64_t block_bytes = int64_t{args.cache.num_kv_heads} * args.cache.head_size * args.cache.block_size *
                              dtype_size(args.cache.dtype);
  if (block_bytes % 16 != 0 || args.num_layers > kMaxGridY || args.num_layers < 0 || args.num_pairs < 0) {
    return cudaErrorInvalidValue;
  }
  if (args.num_pairs == 0 || args.num_layers == 0 || block_bytes == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(args.num_pairs), static_cast<unsigned>(args.num_layers));
  copy_blocks_kernel<<<grid, kThreads, 0, stream>>>(args, block_bytes / 16);
  return cudaGetLastError();
}

}  // namespace vpage::cuda
