// AVX2 + FMA + F16C build of the quantized matmul task (flags in kernels.cmake).
#define VPAGE_ISA_NAMESPACE avx2
#include "quant_gemm_impl.h"
#include "quant_matmul_impl.h"

namespace vpage::cpu::avx2 {

extern const QuantKernels kQuantKernels = {"avx2", &qmm::run_task, &qmm::dequantize_rows, &qmm::quantize_rows_q8,
                                            &qmm::run_dot_task, &qmm::run_gemm_task, qmm::kIntegerX4,
                                            qmm::kIntegerX8, qmm::kNr, qmm::kPanel};

}  // namespace vpage::cpu::avx2
