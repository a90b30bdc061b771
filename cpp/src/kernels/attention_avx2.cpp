// AVX2 + FMA + F16C build of the attention task kernel (flags in kernels.cmake).
#define VPAGE_ISA_NAMESPACE avx2
#include "attention_impl.h"

namespace vpage::cpu::avx2 {

extern const AttentionKernels kKernels = {"avx2", &run_task, &scratch_floats};

}  // namespace vpage::cpu::avx2
