// Tiled prefill attention instantiated for __nv_bfloat16 (one dtype per file keeps the build parallel).
#include "prefill_attention_kernel.cuh"

namespace vpage::cuda::detail {

template cudaError_t launch_prefill_attention_typed<__nv_bfloat16>(const PrefillParams& p, int64_t num_tiles, cudaStream_t stream);

}  // namespace vpage::cuda::detail
