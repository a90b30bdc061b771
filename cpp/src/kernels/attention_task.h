// Work unit of the CPU paged attention and the per-ISA kernel entry points. Included by
// the dispatcher (paged_attention.cpp) and by every ISA build of attention_impl.h, so it
// holds declarations only: no inline code that could be compiled with ISA flags.
#pragma once

#include <cstdint>

#include "vpage/kernels/kernel_args.h"

namespace vpage::cpu {

/// One task: the query rows of `num_queries` consecutive query tokens x `num_heads`
/// consecutive query heads of one GQA group, over context tokens [ctx_begin, ctx_end)
/// of one sequence. Row r = query q * num_heads + head h.
struct AttentionTask {
  int32_t seq = 0;
  int32_t kv_head = 0;
  int32_t first_head = 0;       // first query head (absolute index) of the task
  int32_t num_heads = 0;        // query heads of the task, all in kv_head's group
  int64_t first_query = 0;      // query token (row of query/out) of the first query
  int32_t num_queries = 0;      // 1 for decode
  int32_t first_visible_end = 0;  // first query sees context positions [0, this); +1 per query
                                  // (with args.sliding_window W: [this - W, this))
  int32_t ctx_begin = 0;        // multiple of block_size; blocks before it are never read
  int32_t ctx_end = 0;          // <= context length
  float* partial = nullptr;     // nullptr: write normalised rows to out; else
                                // [rows][2 + head_size] = (max logit, exp sum, unnormalised o)
  const AttentionTask* next = nullptr;  // decode: the task this thread likely runs next, whose
                                        // first K/V group the last group prefetches
};

/// One task of packed attention: queries [first_query, first_query + num_queries) of sequence
/// seq (counted from its first query row), one head, over the keys they see.
struct PackedTask {
  int32_t seq = 0;
  int32_t head = 0;
  int32_t first_query = 0;
  int32_t num_queries = 0;
};

/// Context tokens per K/V tile of packed attention.
constexpr int32_t kPackedTile = 32;

/// Runs one task; `scratch` holds at least scratch_floats(...) floats (64-byte aligned).
using AttentionTaskFn = void (*)(const PagedAttentionArgs& args, const AttentionTask& task,
                                 float* scratch);
using PackedTaskFn = void (*)(const PackedAttentionArgs& args, const PackedTask& task, float* scratch);
/// Floats of scratch that a task of `rows` rows needs.
using ScratchFloatsFn = int64_t (*)(int32_t rows, int32_t head_size, int32_t block_size);

/// The entry points of one ISA build.
struct AttentionKernels {
  const char* name;
  AttentionTaskFn run_task;
  ScratchFloatsFn scratch_floats;
  AttentionTaskFn run_prefill_task;          // prefill tasks (query rows as SIMD lanes)
  ScratchFloatsFn prefill_scratch_floats;    // rows <= 4 * lanes; also packed tasks' (tile kPackedTile)
  PackedTaskFn run_packed_task;              // packed attention tasks (the prefill kernel's rows in lanes)
  int lanes;                                 // fp32 SIMD lanes of this build
};

// One build per instruction set, each in its own namespace (see kernels.cmake).
namespace generic {
extern const AttentionKernels kKernels;
}
namespace avx2 {
extern const AttentionKernels kKernels;
}
namespace avx2vnni {  // the AVX2 attention build under the avx2vnni level's name
extern const AttentionKernels kKernels;
}
namespace avx512 {
extern const AttentionKernels kKernels;
}
namespace avx512vnni {  // the AVX-512 attention build under the avx512vnni level's name
extern const AttentionKernels kKernels;
}
#if defined(VPAGE_AVX512BF16_KERNELS)
namespace avx512bf16 {  // the AVX-512 tasks with bf16 dot products for QK (AVX512-BF16 CPUs)
extern const AttentionTaskFn kDecodeTask;
extern const AttentionTaskFn kPrefillTask;
extern const PackedTaskFn kPackedTask;
}
#endif

/// The build paged_attention uses: the best one the CPU supports, or set_cpu_isa's choice.
const AttentionKernels& selected_kernels();

/// Whether the tasks of `kernels` (an AVX-512 level) are replaced by the avx512bf16 build's:
/// this CPU has AVX512-BF16 and the library was built with it.
bool use_bf16_dot_tasks(const AttentionKernels& kernels);

}  // namespace vpage::cpu
