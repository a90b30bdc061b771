// Batched multi-LoRA on the CPU (Punica's SGMV/BGMV): every row of a batch names an adapter
// slot (or none), and each projection's output gets its row's low-rank update added:
// out[t] += (x[t] @ A_s^T) @ B_s^T, with the adapters' A and B packed by dense_pack
// (dense_matmul.h) and multiplied by the dense matmul's kernels.
#pragma once

#include <cstdint>

#include "vpage/kernels/kernel_args.h"

namespace vpage {

/// Output slices of one projection at most: q, k, v of a fused qkv projection.
constexpr int32_t kMaxLoraSlices = 3;

/// One adapter's weights on one projection (PEFT's lora_A / lora_B, the scaling alpha / r
/// folded into B), packed by dense_pack. Five int64 words, so that Python keeps a table of
/// them as an int64 tensor [num_slots, 5]: (a, b0, b1, b2, rank).
struct LoraAdapterWeights {
  const void* a = nullptr;             // packed [num_slices * rank, k]: slice j's A rows at j * rank;
                                       // nullptr: this adapter leaves the projection alone
  const void* b[kMaxLoraSlices] = {};  // slice j: packed [slice_rows[j], rank], or nullptr (slice untargeted)
  int64_t rank = 0;                    // > 0 where a is set
};
static_assert(sizeof(LoraAdapterWeights) == 5 * sizeof(int64_t), "a table row is 5 int64 words");

/// For every row t with s = token_slots[t] >= 0 and slots[s].a set: T = x[t] @ A_s^T
/// ([num_slices * rank_s], float32), then for each slice j with b[j] set
/// out[t, off_j : off_j + slice_rows[j]] += T[j * rank_s : (j + 1) * rank_s] @ B_{s,j}^T,
/// off_j being the sum of the earlier slice_rows. Adapters of different slots may differ in rank.
struct LoraArgs {
  void* out = nullptr;                      // [m, n], n = sum of slice_rows, row stride out_stride, dtype `dtype`;
                                            // the base projection's output, updated in place
  const void* x = nullptr;                  // [m, k], row stride x_stride, dtype `dtype`: the projection's input
  int64_t m = 0;                            // rows (tokens)
  int32_t k = 0;                            // the projection's input features
  int64_t x_stride = 0;                     // elements between rows of x (>= k)
  int64_t out_stride = 0;                   // elements between rows of out (>= n)
  const int32_t* token_slots = nullptr;     // [m]: the slot of each row in [-1, num_slots), -1 = no adapter
  const LoraAdapterWeights* slots = nullptr;  // [num_slots]
  int32_t num_slots = 0;
  int32_t num_slices = 1;                   // 1 to kMaxLoraSlices
  int32_t slice_rows[kMaxLoraSlices] = {};  // output columns of each slice, in order (qkv: q, k, v rows;
                                            // gate_up: gate, up rows; o, down: one slice)
  DType dtype = DType::kFloat32;            // of x and out
  DType weight_dtype = DType::kFloat32;     // of every packed A and B
};

namespace cpu {

/// Adds the adapters' updates to args.out. Rows are grouped by slot and gathered as float32;
/// then one parallel_for runs every group's shrink (x @ A^T into float32 T, a task per block of
/// a group's rows) and one every group's and slice's expand (T @ B^T, cut as dense_matmul cuts
/// it, each task adding its block into out). Every sum runs in k order, so a row's result does
/// not depend on the other rows of the batch. A call of under 2^18 multiply-adds (a decode step
/// of a few rows) runs on the calling thread. Nothing runs when no row has an adapter.
/// Throws vpage::CheckError on bad sizes, dtypes, slot indices or null pointers, before out is touched.
void lora_add(const LoraArgs& args, int num_threads);

}  // namespace cpu
}  // namespace vpage
