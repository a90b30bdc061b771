// Attention kernels instantiated for __nv_bfloat16 (one dtype per file keeps the build parallel).
#include "attention_kernel.cuh"

namespace vpage::cuda::detail {

template cudaError_t launch_paged_attention_typed<__nv_bfloat16>(const AttentionParams& p, cudaStream_t stream);

}  // namespace vpage::cuda::detail
