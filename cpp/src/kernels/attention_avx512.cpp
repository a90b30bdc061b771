// AVX-512 (F, BW, VL, DQ) build of the attention task kernel (flags in kernels.cmake).
#define VPAGE_ISA_NAMESPACE avx512
#include "attention_decode_fast_impl.h"
#include "attention_prefill_impl.h"

namespace vpage::cpu::avx512 {

extern const AttentionKernels kKernels = {"avx512", &run_task, &decode_scratch_floats, &run_prefill_task, &prefill_scratch_floats, &run_packed_task, kLanes};

}  // namespace vpage::cpu::avx512

namespace vpage::cpu::avx512vnni {

extern const AttentionKernels kKernels = {"avx512vnni", &avx512::run_task, &avx512::decode_scratch_floats,
                                          &avx512::run_prefill_task, &avx512::prefill_scratch_floats, &avx512::run_packed_task,
                                          avx512::kLanes};

}  // namespace vpage::cpu::avx512vnni
