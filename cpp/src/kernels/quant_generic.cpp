// Portable build (baseline flags, left to the auto-vectoriser) of the quantized matmul task (flags in kernels.cmake).
#define VPAGE_ISA_NAMESPACE generic
#include "quant_matmul_impl.h"

namespace vpage::cpu::generic {

extern const QuantKernels kQuantKernels = {"generic", &qmm::run_task, &qmm::dequantize_rows, qmm::kNr, qmm::kPanel};

}  // namespace vpage::cpu::generic
