// AVX-512 build of the decode task with AVX512-BF16 (flags in kernels.cmake): bfloat16 queries
// over a bfloat16 cache score their keys by bf16 dot products (dot_qk_block); every other
// dtype pair runs the AVX-512 build's code. paged_attention.cpp takes it on CPUs with BF16.
#define VPAGE_ISA_NAMESPACE avx512bf16
#include "attention_decode_fast_impl.h"

namespace vpage::cpu::avx512bf16 {

extern const AttentionTaskFn kDecodeTask = &run_task;

}  // namespace vpage::cpu::avx512bf16
