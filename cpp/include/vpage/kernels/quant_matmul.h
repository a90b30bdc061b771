// Matrix multiplication with weights kept in a GGUF (ggml) block format: out = x @ W^T where
// each of W's N rows is K values stored as consecutive quantization blocks, byte for byte as
// in the GGUF file (no float copy). Blocks are dequantized inside the kernel, a weight tile at
// a time, and multiplied in float32.
#pragma once

#include <cstdint>

#include "vpage/common.h"
#include "vpage/kernels/kernel_args.h"

namespace vpage {

/// Block formats, numbered like ggml's `ggml_type` (and gguf's GGMLQuantizationType).
///   kQ4_0: 32 values in 18 bytes: f16 d, 16 bytes of 4-bit q (low nibbles = values 0..15,
///          high nibbles = 16..31); value = d * (q - 8).
///   kQ4_1: 32 values in 20 bytes: f16 d, f16 m, 16 bytes of 4-bit q; value = d * q + m.
///   kQ8_0: 32 values in 34 bytes: f16 d, 32 int8 q; value = d * q.
///   kQ4_K: 256 values in 144 bytes: f16 d, f16 dmin, 12 bytes of eight 6-bit (scale, min)
///          pairs, 128 bytes of 4-bit q; sub-block s of 32: value = d*sc[s]*q - dmin*mn[s].
///   kQ5_K: 256 values in 176 bytes: like kQ4_K plus 32 bytes of fifth bits (bit s of byte l
///          is the high bit of value l of sub-block s) before the 128 nibble bytes.
///   kQ6_K: 256 values in 210 bytes: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8
///          scales (one per 16 values), f16 d; value = d * scale * (q - 32).
/// Not ggml types: kQ4_1x4 and kQ8_0x4 are Q4_1 and Q8_0 rows repacked for this CPU's decode
/// kernel (quant_repack_x4), the same bytes per row: rows go in groups of four (4 * row bytes
/// each), and per block pair p (blocks 2p, 2p + 1) a group holds first the eight d of blocks
/// 2p (rows 0-3) then 2p + 1 (rows 0-3) as f16, then:
///   kQ4_1x4 (160 bytes a pair): the eight m the same way, then for rows 0-3 in turn the 16
///          nibble bytes of block 2p and of block 2p + 1;
///   kQ8_0x4 (272 bytes a pair): for rows 0-3 in turn the quants 0-15 of block 2p, of 2p + 1,
///          then quants 16-31 of block 2p and of 2p + 1 (no quant is -128).
/// A row alone is not addressable: matrices of these types have a multiple of 4 rows and of 64
/// values per row.
/// kQ4_1x8 and kQ8_0x8 are the layouts of the VNNI decode kernel (quant_repack_x8): rows in
/// groups of eight, block by block; per block a group holds the eight d as f16, then
///   kQ4_1x8 (160 bytes a block): the eight m as f16, then four 32-byte vectors: vector j holds
///          in its 4-byte lane r row r's nibble bytes 4j .. 4j + 3 (values 4j .. 4j + 3 in the low
///          nibbles, 16 + 4j .. 19 + 4j in the high ones);
///   kQ8_0x8 (272 bytes a block): eight 32-byte vectors: vector j holds in lane r row r's quants
///          4j .. 4j + 3 plus 128, as unsigned bytes.
/// Matrices of these types have a multiple of 8 rows.
enum class QuantType : int32_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kQ4_1x4 = 259, kQ8_0x4 = 264,
  kQ4_1x8 = 515, kQ8_0x8 = 520
};

/// True when `ggml_type` is one of QuantType's values.
bool quant_type_supported(int32_t ggml_type);

/// Values per block of `type` (32 or 256).
int32_t quant_block_values(QuantType type);

/// Bytes per block of `type`.
int32_t quant_block_bytes(QuantType type);

/// out[m, n] = sum_k x[m, k] * W[n, k], float32 accumulation.
struct QuantMatmulArgs {
  void* out = nullptr;              // [m, n], row stride out_stride, dtype `dtype`
  const void* x = nullptr;          // [m, k], row stride x_stride, dtype `dtype`
  const uint8_t* weight = nullptr;  // [n, k / block_values * block_bytes] raw GGUF blocks or
                                    // x4 or x8 groups, contiguous
  int64_t m = 0;                    // rows of x (tokens)
  int32_t n = 0;                    // rows of W (output features)
  int32_t k = 0;                    // a multiple of quant_block_values(type)
  int64_t x_stride = 0;             // elements between rows of x (>= k)
  int64_t out_stride = 0;           // elements between rows of out (>= n)
  QuantType type = QuantType::kQ4_0;
  DType dtype = DType::kFloat32;    // of x and out
};

namespace cpu {

/// Decode with the 32-value formats (Q4_0, Q4_1, Q8_0) and Q4_K (its 32-value sub-blocks are
/// Q4_1 blocks with 6-bit scales) at up to this many x rows takes the
/// integer path: each x row is rounded to 8 bits per 32 values (ggml's Q8_1 scheme: d =
/// max|x| / 127, q = round(x / d)) and multiplied with the weights' integers, so an output
/// differs from the float product by at most sum_k |w_k| * d_k / 2 (d_k of x's block of k).
/// Measured on Zen 3 (one thread, weights in L2, k = 576 and 1536): Q4_1 2x faster than the
/// float path at 8 rows, 1.5x at 16, 1.4x at 32, 1.2x at 64; Q8_0 1.4x at 8, 1.05x at 16,
/// equal from 32. Prefill chunks of more rows keep the float path's accuracy.
constexpr int64_t kQuantIntegerPathRows = 16;

/// Beyond kQuantIntegerPathRows (decode batches and prefill chunks), the same formats take
/// the integer GEMM path: x rounded as above, each weight tile unpacked once for all rows; a
/// row's output is bitwise the same on either integer path, whatever the batch.
/// Zen 3, one thread, the default model's shapes, against the float path: Q4_1 1.22-1.52x at
/// 17-64 rows, 1.5-1.65x at 128, 1.17-1.31x at 512-2048; Q8_0 0.98-1.37x at 17-64, 1.17-1.26x
/// at 128, 0.99-1.09x at 512-2048 (bench/RESULTS-quant-gemm.md); the default model's prefill 1.11x
/// and batch-64 decode 1.16x. The price is accuracy: test_quant_engine's greedy outputs equal
/// the float32 model's for 3 of 8 prompts (4-6 with prefill on the float path), every other
/// divergence at a near-tie. set_quant_integer_gemm_rows(n) limits the path to n rows (0: off).
/// x8 rows (kQ4_1x8, kQ8_0x8) take the VNNI decode kernel at any number of rows instead, with
/// the same results (its passes of 8 x rows outrun the GEMM: bench/RESULTS-quant-gemm.md).
constexpr int64_t kQuantIntegerGemmMaxRows = int64_t{1} << 40;

/// Runs the matmul. Besides the integer paths above (and for Q5_K, Q6_K), two paths by m: below 128 rows (decode)
/// every weight row is dequantized once, a K chunk at a time, and multiplied with all rows of
/// x by a dot-product micro-kernel; from 128 rows (prefill: compute-bound) a 256-deep tile of
/// 32 (AVX-512: 64) weight rows is dequantized once per 2048 rows of x, transposed, and an
/// outer-product FMA micro-kernel runs over it. Threads: one task per block of weight rows (output columns).
/// 16-bit x is converted to float32 first.
/// Throws vpage::CheckError on a bad type, dtype or sizes.
void quant_matmul(const QuantMatmulArgs& args, int num_threads);

/// Dequantizes `rows` contiguous weight rows of `k` values into float32 `out` [rows, k]
/// (embedding lookups, tests); x4 and x8 types: whole groups from a group's start.
/// Single-threaded. Throws vpage::CheckError on bad sizes.
void quant_dequantize_rows(QuantType type, const uint8_t* weight, int64_t rows, int32_t k, float* out);

/// The repacked type of `type` (kQ4_1 -> kQ4_1x4, kQ8_0 -> kQ8_0x4), or `type` itself when it
/// has none.
constexpr QuantType quant_x4_type(QuantType type) {
  return type == QuantType::kQ4_1 ? QuantType::kQ4_1x4 : type == QuantType::kQ8_0 ? QuantType::kQ8_0x4 : type;
}

/// The x8 type of `type` (kQ4_1 -> kQ4_1x8, kQ8_0 -> kQ8_0x8), or `type` itself when it has none.
constexpr QuantType quant_x8_type(QuantType type) {
  return type == QuantType::kQ4_1 ? QuantType::kQ4_1x8 : type == QuantType::kQ8_0 ? QuantType::kQ8_0x8 : type;
}

/// The file's type of x4 or x8 rows (kQ4_1x4, kQ4_1x8 -> kQ4_1; kQ8_0x4, kQ8_0x8 -> kQ8_0), or
/// `type` itself.
constexpr QuantType quant_file_type(QuantType type) {
  return type == QuantType::kQ4_1x4 || type == QuantType::kQ4_1x8   ? QuantType::kQ4_1
         : type == QuantType::kQ8_0x4 || type == QuantType::kQ8_0x8 ? QuantType::kQ8_0
                                                                     : type;
}

/// Whether `rows` rows of `k` values of `type` have the sizes quant_repack_x4 takes (Q4_1 or
/// Q8_0, rows a multiple of 4, k of 64).
bool quant_repack_x4_fits(QuantType type, int64_t rows, int32_t k);

/// Writes the x4 layout (quant_x4_type) of `rows` rows of `type` of `k` values from `src` into
/// `dst` (the same number of bytes; not in place) and returns true; returns false, writing
/// nothing, for Q8_0 rows holding a quant of -128 (the kQ8_0x4 kernel moves x's sign onto the
/// weights, where -128 has no negation; ggml's quantizer never writes it). Throws
/// vpage::CheckError unless the sizes fit.
bool quant_repack_x4(QuantType type, const uint8_t* src, int64_t rows, int32_t k, uint8_t* dst);

/// Whether `rows` rows of `k` values of `type` have the sizes quant_repack_x8 takes (Q4_1 or
/// Q8_0, rows a multiple of 8).
bool quant_repack_x8_fits(QuantType type, int64_t rows, int32_t k);

/// Writes the x8 layout (quant_x8_type) of `rows` rows of `type` of `k` values from `src` into
/// `dst` (the same number of bytes; not in place). Throws vpage::CheckError unless the sizes fit.
void quant_repack_x8(QuantType type, const uint8_t* src, int64_t rows, int32_t k, uint8_t* dst);

/// The inverse of quant_repack_x4 and quant_repack_x8: rows of an x4 or x8 type back into the
/// file's rows (the paths without a kernel for the layout unpack a task's rows, in L2, and run
/// the file type's kernel: the same results).
void quant_unpack_rows(QuantType type, const uint8_t* src, int64_t rows, int32_t k, uint8_t* dst);

/// Whether the selected instruction set's decode kernel reads x8 rows (the VNNI builds); where
/// it does not, x8 rows still give the same results, unpacked task by task.
bool quant_reads_x8();

/// Sets the most rows the integer GEMM path takes (default kQuantIntegerGemmMaxRows; up to
/// kQuantIntegerPathRows: none, those rows take the float path): for benchmarks and tests.
void set_quant_integer_gemm_rows(int64_t max_rows);

/// Instruction set quant_matmul uses: follows set_cpu_isa ("avx512", "avx2" or "generic").
const char* quant_matmul_isa();

}  // namespace cpu
}  // namespace vpage
