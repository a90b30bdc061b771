// The quantized matmul's kernels built with VPAGE_EMULATE_VNNI: the avx512vnni build's integer
// arithmetic (quant_dot_impl.h's add_dot4, int32 products and reductions) on AVX2, so that
// test_quant_vnni checks that code on CPUs without VNNI. Compiled with AVX2 flags
// (tests/cpp/CMakeLists.txt); called only when the CPU has AVX2.
#define VPAGE_EMULATE_VNNI 1
#define VPAGE_ISA_NAMESPACE vnni_emulated
#include "quant_gemm_impl.h"
#include "quant_matmul_impl.h"

namespace vpage::cpu::vnni_emulated {

extern const QuantKernels kQuantKernels = {"vnni_emulated", &qmm::run_task, &qmm::dequantize_rows,
                                            &qmm::quantize_rows_q8, &qmm::run_dot_task, &qmm::run_gemm_task,
                                            qmm::kIntegerX4, qmm::kIntegerX8, qmm::kNr, qmm::kPanel};

void add_dot4_bytes(const uint8_t* u8, const int8_t* s8, int32_t* acc) {
  const __m256i sum = qmm::add_dot4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc)),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u8)),
                                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s8)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), sum);
}

}  // namespace vpage::cpu::vnni_emulated
