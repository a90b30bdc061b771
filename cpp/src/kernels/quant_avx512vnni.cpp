// AVX-512 build with VNNI (vpdpbusd) of the quantized matmul task (flags in kernels.cmake):
// the same kernels as quant_avx512.cpp, whose integer paths take one vpdpbusd per 32 byte
// products where the others take maddubs and a widening madd.
#define VPAGE_ISA_NAMESPACE avx512vnni
#include "quant_gemm_impl.h"
#include "quant_matmul_impl.h"

namespace vpage::cpu::avx512vnni {

extern const QuantKernels kQuantKernels = {"avx512vnni", &qmm::run_task, &qmm::dequantize_rows,
                                            &qmm::quantize_rows_q8, &qmm::run_dot_task, &qmm::run_gemm_task,
                                            qmm::kIntegerX4, qmm::kIntegerX8, qmm::kNr, qmm::kPanel};

}  // namespace vpage::cpu::avx512vnni
