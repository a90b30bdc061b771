// Device-side KV cache writes and copies: reshape_and_cache and copy_blocks.
#pragma once

#include <cuda_runtime_api.h>

#include "vpage/kernels/kernel_args.h"

namespace vpage::cuda {

/// Writes the key/value rows of args.num_tokens new tokens into their cache slots
/// (slot_mapping[i] < 0 skips token i). All pointers are device pointers.
cudaError_t reshape_and_cache(const ReshapeAndCacheArgs& args, cudaStream_t stream);

/// Copies whole blocks src -> dst in the key and value cache of every layer, all layers and
/// pairs in one launch. args.key_caches/value_caches ([num_layers] pointers) and
/// args.block_mapping ([num_pairs, 2] int64) must be device memory.
cudaError_t copy_blocks(const CopyBlocksArgs& args, cudaStream_t stream);

}  // namespace vpage::cuda
