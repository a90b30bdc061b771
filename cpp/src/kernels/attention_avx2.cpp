// AVX2 + FMA + F16C build of the attention task kernel (flags in kernels.cmake).
#define VPAGE_ISA_NAMESPACE avx2
#include "attention_decode_fast_impl.h"
#include "attention_prefill_impl.h"

namespace vpage::cpu::avx2 {

extern const AttentionKernels kKernels = {"avx2", &run_task, &decode_scratch_floats, &run_prefill_task, &prefill_scratch_floats, &run_packed_task, kLanes};

}  // namespace vpage::cpu::avx2

namespace vpage::cpu::avx2vnni {

extern const AttentionKernels kKernels = {"avx2vnni", &avx2::run_task, &avx2::decode_scratch_floats,
                                          &avx2::run_prefill_task, &avx2::prefill_scratch_floats, &avx2::run_packed_task, avx2::kLanes};

}  // namespace vpage::cpu::avx2vnni
