// Matrix multiplication with float weights (float32, bfloat16 or float16) packed once, at load
// time, into panels of 32 output rows: out = x @ W^T + bias. The panel layout lets one
// outer-product micro-kernel serve decode and prefill alike with no per-call packing, and 16-bit
// weights are widened to float32 in registers (no bf16/f16 arithmetic needed: AVX2 and AVX-512
// without BF16 run them), so a bfloat16 model streams half the bytes of a float32 one.
#pragma once

#include <cstdint>

#include "vpage/kernels/kernel_args.h"

namespace vpage {

/// Output rows (weight rows) per packed panel.
constexpr int32_t kDensePanelRows = 32;

/// Elements of W packed for n rows of k values: ceil(n / 32) panels of [k, 32].
inline int64_t dense_packed_elements(int32_t n, int32_t k) {
  return static_cast<int64_t>((n + kDensePanelRows - 1) / kDensePanelRows) * k * kDensePanelRows;
}

/// out[m, n] = x[m, k] @ W[n, k]^T (+ bias[n]), float32 accumulation.
struct DenseMatmulArgs {
  void* out = nullptr;            // [m, n], row stride out_stride, dtype `dtype`
  const void* x = nullptr;        // [m, k], row stride x_stride, dtype `dtype`
  const void* weight = nullptr;   // packed [ceil(n / 32), k, 32] of dtype weight_dtype (dense_pack)
  const float* bias = nullptr;    // [n] float32, or nullptr
  int64_t m = 0;                  // rows of x (tokens)
  int32_t n = 0;                  // rows of W (output features)
  int32_t k = 0;                  // columns of x and W
  int64_t x_stride = 0;           // elements between rows of x (>= k)
  int64_t out_stride = 0;         // elements between rows of out (>= n)
  DType dtype = DType::kFloat32;         // of x, and of out unless float32_out
  DType weight_dtype = DType::kFloat32;  // of the packed weight
  bool float32_out = false;              // out is float32 whatever dtype is (a 16-bit model's logits)
};

/// The dtype of args.out.
inline DType dense_out_dtype(const DenseMatmulArgs& a) { return a.float32_out ? DType::kFloat32 : a.dtype; }

namespace cpu {

/// Packs W [n, k] (row stride w_stride elements, dtype `dtype`) into `packed`
/// [ceil(n / 32), k, 32]: packed[p][j][c] = W[32 p + c][j], zeros past row n. Threads over
/// panels. Throws vpage::CheckError on bad sizes or a null pointer.
void dense_pack(DType dtype, const void* weight, int32_t n, int32_t k, int64_t w_stride, void* packed,
                int num_threads);

/// Runs the matmul: tasks of (a block of x rows, a run of panels); inside a task each panel is
/// multiplied 256 values of k at a time with every row of the block (the panel chunk stays in
/// L1/L2 while the rows stream), by a micro-kernel of 6 (AVX2) or 8 (AVX-512) rows x 16 or 32
/// columns of float32 accumulators. 16-bit x is converted to float32 first (bfloat16 x with
/// bfloat16 weights on "avx512bf16": see dense_matmul_isa). Each output is summed in k order,
/// so a row's result does not depend on the batch it is in.
/// Throws vpage::CheckError on a bad dtype, sizes or a null pointer.
void dense_matmul(const DenseMatmulArgs& args, int num_threads);

/// Instruction set dense_matmul uses: follows set_cpu_isa ("avx512", "avx2" or "generic"), with
/// "avx512bf16" for an AVX-512 level on a CPU with AVX512-BF16: there bfloat16 x bfloat16
/// matmuls use bf16 dot products (`vdpbf16ps`: exact products, two float32 additions per lane
/// and pair of k, denormals flushed), the rest as "avx512".
const char* dense_matmul_isa();

}  // namespace cpu
}  // namespace vpage
