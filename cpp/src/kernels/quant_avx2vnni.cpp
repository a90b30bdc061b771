// AVX2 build with AVX-VNNI (the VEX vpdpbusd of CPUs without AVX-512) of the quantized matmul
// task (flags in kernels.cmake): quant_avx2.cpp's kernels with quant_avx512vnni.cpp's
// integer dot products.
#define VPAGE_ISA_NAMESPACE avx2vnni
#include "quant_gemm_impl.h"
#include "quant_matmul_impl.h"

namespace vpage::cpu::avx2vnni {

extern const QuantKernels kQuantKernels = {"avx2vnni", &qmm::run_task, &qmm::dequantize_rows, &qmm::quantize_rows_q8,
                                            &qmm::run_dot_task, &qmm::run_gemm_task, qmm::kIntegerX4,
                                            qmm::kIntegerX8, qmm::kNr, qmm::kPanel};

}  // namespace vpage::cpu::avx2vnni
