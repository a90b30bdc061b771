// AVX-512 build of the attention tasks with AVX512-BF16 (flags in kernels.cmake): bfloat16
// queries over bfloat16 keys score them by bf16 dot products (decode: dot_qk_block; prefill and
// packed attention: pf_qk_dot); every other dtype pair runs the AVX-512 build's code.
// paged_attention.cpp and packed_attention.cpp take these tasks on CPUs with BF16.
#define VPAGE_ISA_NAMESPACE avx512bf16
#include "attention_decode_fast_impl.h"
#include "attention_prefill_impl.h"

namespace vpage::cpu::avx512bf16 {

extern const AttentionTaskFn kDecodeTask = &run_task;
extern const AttentionTaskFn kPrefillTask = &run_prefill_task;
extern const PackedTaskFn kPackedTask = &run_packed_task;

}  // namespace vpage::cpu::avx512bf16
