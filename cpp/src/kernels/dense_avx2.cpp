// AVX2 + FMA + F16C build of the dense matmul task (flags in kernels.cmake).
#define VPAGE_ISA_NAMESPACE avx2
#include "dense_matmul_impl.h"

namespace vpage::cpu::avx2 {

extern const DenseKernels kDenseKernels = {"avx2", &dense::run_task, nullptr};

}  // namespace vpage::cpu::avx2
