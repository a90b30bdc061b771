// Portable build (baseline flags) of the attention task kernel.
#define VPAGE_ISA_NAMESPACE generic
#include "attention_decode_fast_impl.h"
#include "attention_prefill_impl.h"

namespace vpage::cpu::generic {

extern const AttentionKernels kKernels = {"generic", &run_task, &decode_scratch_floats, &run_prefill_task, &prefill_scratch_floats, &run_packed_task, kLanes};

}  // namespace vpage::cpu::generic
