// Attention kernels instantiated for float (one dtype per file keeps the build parallel).
#include "attention_kernel.cuh"

namespace vpage::cuda::detail {

template cudaError_t launch_paged_attention_typed<float>(const AttentionParams& p, cudaStream_t stream);

}  // namespace vpage::cuda::detail
