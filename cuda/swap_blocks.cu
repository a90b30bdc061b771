// swap_blocks (host only): batched cudaMemcpyAsync between block pools, and SwapStream.
#include "vpage/cuda/swap.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace vpage::cuda {

cudaError_t swap_blocks(const SwapBlocksArgs& args, cudaStream_t stream) {
  if (args.num_pairs < 0 || args.block_bytes < 0) return cudaErrorInvalidValue;
  if (args.num_pairs == 0 || args.block_bytes == 0) return cudaSuccess;
  // Sorting by source block lets runs that the caller listed out of order merge too.
  std::vector<std::pair<int64_t, int64_t>> pairs(static_cast<size_t>(args.num_pairs));
  for (int64_t i = 0; i < args.num_pairs; ++i) {
    pairs[i] = {args.block_mapping[2 * i], args.block_mapping[2 * i + 1]};
  }
  std::sort(pairs.begin(), pairs.end());
  const char* src = static_cast<const char*>(args.src);
  char* dst = static_cast<char*>(args.dst);
  size_t run_start = 0;
  for (size_t i = 1; i <= pairs.size(); ++i) {
    const bool extends = i < pairs.size() && pairs[i].first == pairs[i - 1].first + 1 &&
                         pairs[i].second == pairs[i - 1].second + 1;
    if (extends) continue;
    const int64_t num_blocks = static_cast<int64_t>(i - run_start);
    const cudaError_t err =
        cudaMemcpyAsync(dst + pairs[run_start].second * args.block_bytes, src + pairs[run_start].first * args.block_bytes,
                        static_cast<size_t>(num_blocks * args.block_bytes), cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return err;
    run_start = i;
  }
  return cudaSuccess;
}

SwapStream::~SwapStream() {
  if (compute_done_ != nullptr) cudaEventDestroy(compute_done_);
  if (done_ != nullptr) cudaEventDestroy(done_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

cudaError_t SwapStream::init() {
  if (stream_ != nullptr) return cudaSuccess;
  cudaError_t err = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&done_, cudaEventDisableTiming);
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming);
  return err;
}

cudaError_t SwapStream::join(cudaStream_t compute) {
  const cudaError_t err = cudaEventRecord(done_, stream_);
  return err != cudaSuccess ? err : cudaStreamWaitEvent(compute, done_, 0);
}

cudaError_t SwapStream::wait_for(cudaStream_t compute) {
  const cudaError_t err = cudaEventRecord(compute_done_, compute);
  return err != cudaSuccess ? err : cudaStreamWaitEvent(stream_, compute_done_, 0);
}

}  // namespace vpage::cuda
