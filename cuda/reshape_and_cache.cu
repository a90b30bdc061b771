// reshape_and_cache: scatters the K/V rows of new tokens into their cache slots.
//
// Grid and threads: one thread block (128 threads) per token; threads stride over the
// token's 16-byte key fragments (num_kv_heads * head_size / x, one 16-byte store each
// into [block, head, fragment, offset, :]) and then over its value elements
// ([block, head, d, offset], one element each). Elements are copied bit for bit, so
// kernels are instantiated per element size, not per dtype.
#include "vpage/cuda/cache_ops.h"

#include <cstdint>

#include "dtype_utils.cuh"

namespace vpage::cuda {
namespace {

constexpr int kThreads = 128;

template <typename E, bool kAligned>
__global__ void __launch_bounds__(kThreads) reshape_and_cache_kernel(const ReshapeAndCacheArgs a) {
  constexpr int kX = 16 / static_cast<int>(sizeof(E));
  const int64_t token = blockIdx.x;
  const int64_t slot = a.slot_mapping[token];
  if (slot < 0) return;
  const int block_size = a.cache.block_size;
  const int head_size = a.cache.head_size;
  const int64_t block = slot / block_size;
  const int64_t offset = slot % block_size;
  const int64_t head_elems = int64_t{a.cache.num_kv_heads} * head_size;

  const E* key = static_cast<const E*>(a.key) + token * a.key_stride;
  E* key_cache = static_cast<E*>(a.key_cache) + block * head_elems * block_size;
  const int num_frags = static_cast<int>(head_elems / kX);
  for (int i = threadIdx.x; i < num_frags; i += kThreads) {
    E* dst = key_cache + (int64_t{i} * block_size + offset) * kX;
    const E* src = key + int64_t{i} * kX;
    if constexpr (kAligned) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
#pragma unroll
      for (int j = 0; j < kX; ++j) dst[j] = src[j];
    }
  }

  const E* value = static_cast<const E*>(a.value) + token * a.value_stride;
  E* value_cache = static_cast<E*>(a.value_cache) + block * head_elems * block_size;
  for (int64_t i = threadIdx.x; i < head_elems; i += kThreads) value_cache[i * block_size + offset] = value[i];
}

template <typename E>
cudaError_t launch(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  const bool aligned = reinterpret_cast<uintptr_t>(a.key) % 16 == 0 &&
                       (a.key_stride * static_cast<int64_t>(sizeof(E))) % 16 == 0;
  const dim3 grid(static_cast<unsigned>(a.num_tokens));
  if (aligned) {
    reshape_and_cache_kernel<E, true><<<grid, kThreads, 0, stream>>>(a);
  } else {
    reshape_and_cache_kernel<E, false><<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t reshape_and_cache(const ReshapeAndCacheArgs& args, cudaStream_t stream) {
  const int x = key_pack_size(args.cache.dtype);
  if (args.cache.head_size <= 0 || args.cache.head_size % x != 0 || args.cache.block_size <= 0 ||
      args.num_tokens < 0) {
    return cudaErrorInvalidValue;
  }
  if (args.num_tokens == 0) return cudaSuccess;
  return dtype_size(args.cache.dtype) == 4 ? launch<uint32_t>(args, stream) : launch<uint16_t>(args, stream);
}

}  // namespace vpage::cuda
