// AVX-512 build of the dense matmul task with AVX512-BF16 (flags in kernels.cmake): the float
// kernels, and bfloat16 x bfloat16 matmuls with bf16 dot products (dense_bf16_dot.h).
#define VPAGE_ISA_NAMESPACE avx512bf16
#include "dense_bf16_dot.h"
#include "dense_matmul_impl.h"

namespace vpage::cpu::avx512bf16 {

extern const DenseKernels kDenseKernels = {"avx512bf16", &dense::run_task, &run_bf16_dot_task};

}  // namespace vpage::cpu::avx512bf16
