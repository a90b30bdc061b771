// Block swaps between a device cache and a pinned host cache, and a side stream to
// overlap them with compute.
#pragma once

#include <cuda_runtime_api.h>

#include "vpage/kernels/kernel_args.h"

namespace vpage::cuda {

/// Copies whole blocks between two pools (device <-> pinned host, or any pair that
/// cudaMemcpyDefault accepts), asynchronously on `stream`: one cudaMemcpyAsync per run of
/// pairs whose src and dst blocks are both consecutive. args.block_mapping is host memory
/// and is read before the call returns; dst blocks must be distinct.
cudaError_t swap_blocks(const SwapBlocksArgs& args, cudaStream_t stream);

/// A non-blocking stream for swaps plus an event, so that the compute stream waits for the
/// swaps only where it needs their blocks:
///   SwapStream s; s.init(); swap_blocks(args, s.stream()); ...; s.join(compute_stream);
/// Host memory must be pinned for the copies to run asynchronously.
class SwapStream {
 public:
  SwapStream() = default;
  SwapStream(const SwapStream&) = delete;
  SwapStream& operator=(const SwapStream&) = delete;
  ~SwapStream();

  /// Creates the stream and event on the current device.
  cudaError_t init();
  /// The stream to pass to swap_blocks.
  cudaStream_t stream() const { return stream_; }
  /// Records the event after the work queued so far and makes `compute` wait for it
  /// (on the device; the host does not block).
  cudaError_t join(cudaStream_t compute);
  /// Makes the swap stream wait for the work queued so far on `compute` (e.g. before
  /// swapping out blocks that compute still writes).
  cudaError_t wait_for(cudaStream_t compute);

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
  cudaEvent_t compute_done_ = nullptr;
};

}  // namespace vpage::cuda
