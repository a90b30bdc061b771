// Token bitmasks of structured outputs on the GPU (layout: vpage/kernels/token_bitmask.h).
#pragma once

#include <cuda_runtime_api.h>

#include "vpage/kernels/token_bitmask.h"

namespace vpage::cuda {

/// In place: -inf into the device logits wherever the device bitmask has a 0 bit (the CPU
/// twin is vpage::cpu::apply_token_bitmask, same arguments). Returns cudaErrorInvalidValue on
/// bad sizes, else the launch's error. Launches on `stream` (of the current device).
cudaError_t apply_token_bitmask(const TokenBitmaskArgs& args, cudaStream_t stream);

}  // namespace vpage::cuda
