// AVX2 + FMA + F16C build of the attention task kernel (flags in kernels.cmake).
#define VPAGE_ISA_NAMESPACE avx2
#include "attention_decode_fast_impl.h"
#include "attention_prefill_impl.h"

namespace vpage::cpu::avx2 {

extern const AttentionKernels kKernels = {"avx2", &run_task, &decode_scratch_floats, &run_prefill_task, &prefill_scratch_floats, kLanes};

}  // namespace vpage::cpu::avx2
