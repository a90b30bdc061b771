// Portable build (baseline flags, left to the auto-vectoriser) of the dense matmul task (flags in kernels.cmake).
#define VPAGE_ISA_NAMESPACE generic
#include "dense_matmul_impl.h"

namespace vpage::cpu::generic {

extern const DenseKernels kDenseKernels = {"generic", &dense::run_task, nullptr};

}  // namespace vpage::cpu::generic
