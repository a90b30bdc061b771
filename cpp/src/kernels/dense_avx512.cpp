// AVX-512 (F, BW, VL, DQ) build of the dense matmul task (flags in kernels.cmake).
#define VPAGE_ISA_NAMESPACE avx512
#include "dense_matmul_impl.h"

namespace vpage::cpu::avx512 {

extern const DenseKernels kDenseKernels = {"avx512", &dense::run_task, nullptr};

}  // namespace vpage::cpu::avx512
