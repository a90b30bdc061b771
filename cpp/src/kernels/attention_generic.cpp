// Portable build (baseline flags) of the attention task kernel.
#define VPAGE_ISA_NAMESPACE generic
#include "attention_impl.h"

namespace vpage::cpu::generic {

extern const AttentionKernels kKernels = {"generic", &run_task, &scratch_floats};

}  // namespace vpage::cpu::generic
