// apply_token_bitmask on the GPU.
//
// Grid and threads: blockIdx.y strides over the rows, blockIdx.x over tiles of kThreads
// tokens; thread i of a tile owns one token. A warp's 32 tokens are one bitmask word (tiles
// start at multiples of 32), so the warp reads that word once (a broadcast) and only the
// threads of disallowed tokens write; the logits are never read.
#include "vpage/cuda/token_bitmask.h"

#include <cstdint>

#include <math_constants.h>

namespace vpage::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGridY = 65535;

__global__ void __launch_bounds__(kThreads) apply_token_bitmask_kernel(const TokenBitmaskArgs a) {
  const int64_t token = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (token >= a.vocab) return;
  for (int64_t r = blockIdx.y; r < a.num_rows; r += gridDim.y) {
    const uint32_t word = static_cast<uint32_t>(a.bitmask[r * a.bitmask_stride + token / 32]);
    if (((word >> (token % 32)) & 1u) == 0) a.logits[r * a.row_stride + token] = -CUDART_INF_F;
  }
}

}  // namespace

cudaError_t apply_token_bitmask(const TokenBitmaskArgs& args, cudaStream_t stream) {
  if (args.num_rows < 0 || args.vocab <= 0 || args.row_stride < args.vocab ||
      args.bitmask_stride < token_bitmask_words(args.vocab)) {
    return cudaErrorInvalidValue;
  }
  if (args.num_rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((args.vocab + kThreads - 1) / kThreads),
                  static_cast<unsigned>(args.num_rows < kMaxGridY ? args.num_rows : kMaxGridY));
  apply_token_bitmask_kernel<<<grid, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace vpage::cuda
