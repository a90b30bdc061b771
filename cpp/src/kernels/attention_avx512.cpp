// AVX-512 (F, BW, VL, DQ) build of the attention task kernel (flags in kernels.cmake).
#define VPAGE_ISA_NAMESPACE avx512
#include "attention_impl.h"

namespace vpage::cpu::avx512 {

extern const AttentionKernels kKernels = {"avx512", &run_task, &scratch_floats};

}  // namespace vpage::cpu::avx512
