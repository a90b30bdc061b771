// Quantized matmul dispatcher: checks the arguments, converts 16-bit x to float32, picks the
// ISA build that set_cpu_isa selected for attention, plans the tasks and runs them on the
// kernels' parallel_for. Also the block-format tables.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "attention_task.h"
#include "float_rows.h"
#include "quant_task.h"
#include "thread_pool.h"
#include "vpage/common.h"
#include "vpage/kernels/quant_matmul.h"

namespace vpage {

bool quant_type_supported(int32_t ggml_type) {
  switch (static_cast<QuantType>(ggml_type)) {
    case QuantType::kQ4_0:
    case QuantType::kQ4_1:
    case QuantType::kQ8_0:
    case QuantType::kQ4_K:
    case QuantType::kQ5_K:
    case QuantType::kQ6_K:
    case QuantType::kQ4_1x4:
    case QuantType::kQ8_0x4:
    case QuantType::kQ4_1x8:
    case QuantType::kQ8_0x8:
      return true;
  }
  return false;
}

int32_t quant_block_values(QuantType type) {
  return type == QuantType::kQ4_K || type == QuantType::kQ5_K || type == QuantType::kQ6_K ? 256 : 32;
}

int32_t quant_block_bytes(QuantType type) {
  switch (type) {
    case QuantType::kQ4_0: return 18;
    case QuantType::kQ4_1:
    case QuantType::kQ4_1x4:
    case QuantType::kQ4_1x8: return 20;
    case QuantType::kQ8_0:
    case QuantType::kQ8_0x4:
    case QuantType::kQ8_0x8: return 34;
    case QuantType::kQ4_K: return 144;
    case QuantType::kQ5_K: return 176;
    case QuantType::kQ6_K: return 210;
  }
  return 0;
}

namespace cpu {
namespace {

// Below this many x rows the row-major tile and dot-product micro-kernel (one pass over the
// weights for all rows) is at least as fast as the k-major one, whose tile transposition
// costs as much as the multiply for few rows (CPU time on Zen 3, single thread: 40 vs 31
// GFLOP/s at 32 rows, 48-64 vs 43-56 at 64, equal at 128).
constexpr int64_t kDecodeRows = 128;
// Decode tile: 16 rows x 2048 floats = 128 KiB (L2). Long K chunks read each weight row in
// one contiguous run (K 1536 at m = 1: 0.6x the time of 512-value chunks).
constexpr int32_t kDecodeRowGroups = 4;  // rows per task: 4 micro-kernel column groups
constexpr int32_t kDecodeKChunk = 2048;
constexpr int32_t kPrefillPanels = 2;    // prefill task: 2 micro-kernel panels (32 or 64 weight rows)
constexpr int32_t kPrefillKChunk = 256;  // prefill tile: 256 x 32 floats = 32 KiB (AVX2)
constexpr int64_t kPrefillMChunk = 2048;  // x rows per tile fill (x streams from L2/L3)

// Integer decode path (quant_dot_impl.h): long contiguous runs of weight rows keep each core's
// hardware prefetcher streaming (with 32-row tasks handed out alternately, 2 threads read a
// 66 MB matrix slower than one), but tasks handed out from a shared counter balance the threads
// only to within a task: with 2 tasks per thread, one thread could wait up to a quarter of a
// matmul at its end (2-vCPU Zen 3, 1.7B Q4_1 decode: the pool's threads spun 5-10% of their
// time). So a matmul is cut into head tasks, one per thread, over kDotHeadShare of the rows,
// then tail tasks of kDotTailShare of the rows each (rows a multiple of 8, whole x8 groups, at
// least kDotMinTaskRows): a thread waits at most about one tail task.
constexpr double kDotHeadShare = 0.75;
constexpr double kDotTailShare = 1.0 / 16;
constexpr int32_t kDotMinTaskRows = 32;

int32_t round_up8(double rows) { return static_cast<int32_t>(std::ceil(rows / 8.0)) * 8; }

struct DotTaskShape {
  int32_t head_tasks, head_rows, tail_rows;
  int64_t num_tasks;
};

DotTaskShape dot_task_shape(int32_t n, int num_threads) {
  DotTaskShape shape;
  shape.head_rows = std::max(kDotMinTaskRows, round_up8(n * kDotHeadShare / num_threads));
  shape.head_tasks = static_cast<int32_t>(std::min<int64_t>(num_threads, (n + shape.head_rows - 1) / shape.head_rows));
  shape.tail_rows = std::max(kDotMinTaskRows, round_up8(n * kDotTailShare));
  const int64_t tail = std::max<int64_t>(0, n - static_cast<int64_t>(shape.head_tasks) * shape.head_rows);
  shape.num_tasks = shape.head_tasks + (tail + shape.tail_rows - 1) / shape.tail_rows;
  return shape;
}

// The 32-value formats, and Q4_K, whose sub-blocks are Q4_1 blocks with 6-bit scales.
bool integer_format(const QuantMatmulArgs& a) {
  return a.type == QuantType::kQ4_0 || a.type == QuantType::kQ4_1 || a.type == QuantType::kQ8_0 ||
         a.type == QuantType::kQ4_K || quant_is_repacked(a.type);
}

std::atomic<int64_t> gemm_max_rows{kQuantIntegerGemmMaxRows};

// The VNNI decode kernel also takes x8 rows beyond kQuantIntegerPathRows, up to where the
// integer GEMM would (per x row it runs 1.6x faster than the GEMM: bench/RESULTS-quant-gemm.md).
bool use_dot_path(const QuantMatmulArgs& a) {
  return integer_format(a) &&
         (a.m <= kQuantIntegerPathRows || (quant_is_x8(a.type) && selected_quant_kernels().integer_x8 &&
                                           a.m <= gemm_max_rows.load(std::memory_order_relaxed)));
}

// Integer GEMM path (quant_gemm_impl.h): tasks of kGemmTaskRows weight rows, each unpacked once
// into a tile (Q4, k = 1536: 32 rows x 24 pairs x 128 bytes = 96 KiB, in L2).
constexpr int32_t kGemmTaskRows = 32;

bool use_gemm_path(const QuantMatmulArgs& a) {
  return integer_format(a) && !use_dot_path(a) && a.m > kQuantIntegerPathRows &&
         a.m <= gemm_max_rows.load(std::memory_order_relaxed);
}

// Rows of x quantized per parallel_for task (x quantization is a few percent of a GEMM).
constexpr int64_t kQuantizeRowsPerTask = 64;  // a multiple of the x group (4 rows)

void check_args(const QuantMatmulArgs& a) {
  VPAGE_CHECK(quant_type_supported(static_cast<int32_t>(a.type)),
              "quant_matmul: unsupported quantization type "
                  << static_cast<int32_t>(a.type)
                  << " (expected Q4_0=2, Q4_1=3, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14, Q4_1x4=259, Q8_0x4=264, "
                     "Q4_1x8=515 or Q8_0x8=520)");
  VPAGE_CHECK(a.dtype == DType::kFloat32 || a.dtype == DType::kFloat16 || a.dtype == DType::kBFloat16,
              "quant_matmul: unknown dtype code " << static_cast<int>(a.dtype));
  const int32_t block = quant_block_values(a.type);
  VPAGE_CHECK(a.m >= 0 && a.n >= 0 && a.k > 0 && a.k % block == 0 && a.x_stride >= a.k && a.out_stride >= a.n,
              "quant_matmul: bad sizes (m " << a.m << ", n " << a.n << ", k " << a.k << " must be a positive multiple of "
                                            << block << ", x_stride " << a.x_stride << ", out_stride " << a.out_stride
                                            << ")");
  VPAGE_CHECK(!quant_is_x4(a.type) || quant_repack_x4_fits(quant_file_type(a.type), a.n, a.k),
              "quant_matmul: x4 weights need n a multiple of 4 and k of 64 (n " << a.n << ", k " << a.k << ")");
  VPAGE_CHECK(!quant_is_x8(a.type) || quant_repack_x8_fits(quant_file_type(a.type), a.n, a.k),
              "quant_matmul: x8 weights need n a multiple of 8 (n " << a.n << ")");
  VPAGE_CHECK((a.m == 0 || (a.x != nullptr && a.out != nullptr)) && (a.n == 0 || a.weight != nullptr),
              "quant_matmul: null pointer");
}

}  // namespace

const QuantKernels& selected_quant_kernels() {
  const char* name = selected_kernels().name;
#if defined(VPAGE_X86_KERNELS)
  if (std::strcmp(name, "avx512vnni") == 0) return avx512vnni::kQuantKernels;
  if (std::strcmp(name, "avx512") == 0) return avx512::kQuantKernels;
#if defined(VPAGE_AVX2VNNI_KERNELS)
  if (std::strcmp(name, "avx2vnni") == 0) return avx2vnni::kQuantKernels;
#endif
  if (std::strcmp(name, "avx2") == 0) return avx2::kQuantKernels;
#endif
  (void)name;
  return generic::kQuantKernels;
}

QuantizedX quant_quantize_x(const QuantMatmulArgs& a, const float* x, int64_t x_stride, int num_threads) {
  const QuantKernels& kernels = selected_quant_kernels();
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xd, xs, pairs;
  thread_local std::vector<int32_t> sums;
  const int32_t blocks = a.k / 32;
  const int64_t q_stride = quant_x_row_bytes(a.k);
  const int64_t group_floats = quant_x_group_floats(blocks);
  xq.resize(static_cast<size_t>(a.m) * q_stride);
  xd.resize(static_cast<size_t>(a.m) * blocks);
  xs.resize(static_cast<size_t>(a.m) * blocks);
  sums.resize(static_cast<size_t>(a.m) * blocks);
  pairs.resize(static_cast<size_t>((a.m + 3) / 4 * group_floats));
  // The lambda runs on other threads: it must see this thread's buffers, not its own thread_locals.
  const QuantizedX qx{xq.data(), q_stride, xd.data(), xs.data(), pairs.data(), sums.data()};
  int8_t* q_out = xq.data();
  float* d_out = xd.data();
  float* s_out = xs.data();
  float* pairs_out = pairs.data();
  int32_t* sums_out = sums.data();
  const int64_t tasks = (a.m + kQuantizeRowsPerTask - 1) / kQuantizeRowsPerTask;
  ThreadPool::instance().parallel_for(tasks, num_threads, [&](int64_t task, int) {
    const int64_t i0 = task * kQuantizeRowsPerTask;
    const int64_t rows = std::min(kQuantizeRowsPerTask, a.m - i0);
    float* d = d_out + i0 * blocks;
    float* s = s_out + i0 * blocks;
    kernels.quantize_x(x + i0 * x_stride, x_stride, rows, a.k, q_out + i0 * q_stride, d, s, sums_out + i0 * blocks);
    quant_x_pairs(a.type, d, s, rows, blocks, pairs_out + i0 / 4 * group_floats);  // i0: a multiple of 4
  });
  return qx;
}

void quant_store_out(const QuantMatmulArgs& a, int64_t row, int32_t col0, int32_t cols, const float* values) {
  const int64_t offset = (row * a.out_stride + col0) * dtype_size(a.dtype);
  store_float32_row(a.dtype, static_cast<char*>(a.out) + offset, values, nullptr, cols);
}

void quant_x_pairs(QuantType type, const float* d, const float* s, int64_t m, int32_t blocks, float* pairs) {
  const int32_t num_pairs = (blocks + 1) / 2;
  std::fill(pairs, pairs + (m + 3) / 4 * quant_x_group_floats(blocks), 0.0f);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t lane = i % 4;
    for (int32_t b = 0; b < blocks; ++b) {
      float* out = pairs + (i / 4 * num_pairs + b / 2) * kXPairFloats + 4 * (b % 2) + lane;
      const int64_t xb = i * blocks + b;
      out[0] = d[xb];
      if (quant_file_type(type) == QuantType::kQ4_1 || type == QuantType::kQ4_K) out[8] = s[xb];
      if (type == QuantType::kQ4_0) out[8] = -8.0f * s[xb];
    }
  }
}

bool quant_integer_path(const QuantMatmulArgs& args) { return use_dot_path(args) || use_gemm_path(args); }

QuantizedX quant_x_rows(const QuantizedX& qx, int32_t k, int64_t first_row) {
  const int32_t blocks = k / 32;
  return {qx.q + first_row * qx.q_stride, qx.q_stride, qx.d + first_row * blocks, qx.s + first_row * blocks,
          qx.pairs + first_row / 4 * quant_x_group_floats(blocks), qx.sums + first_row * blocks};
}

QuantMatmulTasks quant_matmul_tasks(const QuantMatmulArgs& args, const float* x, int64_t x_stride,
                                    const QuantizedX& qx, int num_threads) {
  QuantMatmulTasks tasks;
  tasks.args = args;
  tasks.x = x;
  tasks.x_stride = x_stride;
  tasks.qx = qx;
  tasks.kernels = &selected_quant_kernels();
  num_threads = std::max(num_threads, 1);
  if (quant_integer_path(args)) {
    // The SIMD builds' GEMM reads x4 and x8 rows (integer_x4), only VNNI's decode path x8 rows.
    const bool reads_rows = quant_is_x8(args.type) && use_dot_path(args) ? tasks.kernels->integer_x8
                                                                         : tasks.kernels->integer_x4;
    tasks.unpack_rows = quant_is_repacked(args.type) && !reads_rows;
    if (use_dot_path(args)) {
      const DotTaskShape shape = dot_task_shape(args.n, num_threads);
      tasks.integer_task = tasks.kernels->run_dot_task;
      tasks.head_tasks = shape.head_tasks;
      tasks.head_rows = shape.head_rows;
      tasks.integer_rows = shape.tail_rows;
      tasks.num_tasks = shape.num_tasks;
    } else {
      tasks.integer_task = tasks.kernels->run_gemm_task;
      tasks.integer_rows = kGemmTaskRows;
      tasks.num_tasks = (args.n + kGemmTaskRows - 1) / kGemmTaskRows;
    }
    return tasks;
  }
  QuantPlan& plan = tasks.plan;
  if (args.m < kDecodeRows) {
    plan.rows_per_task = kDecodeRowGroups * tasks.kernels->rows_multiple;
    plan.k_chunk = kDecodeKChunk;
    plan.m_chunk = args.m;
  } else {
    plan.rows_per_task = kPrefillPanels * tasks.kernels->panel_rows;
    plan.k_chunk = kPrefillKChunk;
    plan.m_chunk = kPrefillMChunk;
    plan.k_major = true;
  }
  tasks.num_tasks = (args.n + plan.rows_per_task - 1) / plan.rows_per_task;
  tasks.unpack_rows = quant_is_repacked(args.type);
  return tasks;
}

int32_t QuantMatmulTasks::task_rows(int64_t task, int32_t* n0, int32_t* rows) const {
  int32_t task_size;
  if (task < head_tasks) {
    task_size = head_rows;
    *n0 = static_cast<int32_t>(task * head_rows);
  } else {
    task_size = integer_task != nullptr ? integer_rows : plan.rows_per_task;
    *n0 = static_cast<int32_t>(static_cast<int64_t>(head_tasks) * head_rows + (task - head_tasks) * task_size);
  }
  *rows = std::min(task_size, args.n - *n0);
  return task_size;
}

QuantMatmulArgs QuantMatmulTasks::rows_args(int32_t n0, int32_t rows) const {
  QuantMatmulArgs part = args;
  part.weight = args.weight + n0 * (static_cast<int64_t>(args.k / quant_block_values(args.type)) *
                                    quant_block_bytes(args.type));
  part.n = rows;
  part.out = static_cast<char*>(args.out) + static_cast<int64_t>(n0) * dtype_size(args.dtype);
  return part;
}

// An integer task runs its rows as task 0 of a matmul of those rows alone (tasks may differ in
// size; a row's result does not depend on its task).
void QuantMatmulTasks::run(int64_t task) const {
  if (unpack_rows) {
    run_unpacked(task);
  } else if (integer_task != nullptr) {
    int32_t n0, rows;
    const int32_t task_size = task_rows(task, &n0, &rows);
    integer_task(rows_args(n0, rows), qx, task_size, 0);
  } else {
    kernels->run_task(args, x, x_stride, plan, task);
  }
}

// The task's x4 or x8 rows (every task covers whole groups: its rows and first row are
// multiples of 8) as the file's rows in this thread's buffer, then that type's kernel on them as task 0 of a matmul
// of those rows alone.
void QuantMatmulTasks::run_unpacked(int64_t task) const {
  int32_t n0, rows;
  const int32_t task_size = task_rows(task, &n0, &rows);
  QuantMatmulArgs part = rows_args(n0, rows);
  thread_local std::vector<uint8_t> unpacked;
  unpacked.resize(static_cast<size_t>(rows) * (args.k / 32) * quant_block_bytes(args.type));
  quant_unpack_rows(args.type, part.weight, rows, args.k, unpacked.data());
  part.type = quant_file_type(args.type);
  part.weight = unpacked.data();
  if (integer_task != nullptr) {
    integer_task(part, qx, task_size, 0);
  } else {
    kernels->run_task(part, x, x_stride, plan, 0);
  }
}

void quant_matmul(const QuantMatmulArgs& args, int num_threads) {
  check_args(args);
  if (args.m == 0 || args.n == 0) return;
  num_threads = std::max(num_threads, 1);
  thread_local std::vector<float> converted;
  int64_t x_stride = 0;
  const float* x = float32_rows(args.dtype, args.x, args.m, args.k, args.x_stride, converted, &x_stride, num_threads);
  const QuantizedX qx = quant_integer_path(args) ? quant_quantize_x(args, x, x_stride, num_threads) : QuantizedX{};
  const QuantMatmulTasks tasks = quant_matmul_tasks(args, x, x_stride, qx, num_threads);
  ThreadPool::instance().parallel_for(tasks.num_tasks, num_threads, [&](int64_t task, int) { tasks.run(task); });
}

void quant_dequantize_rows(QuantType type, const uint8_t* weight, int64_t rows, int32_t k, float* out) {
  VPAGE_CHECK(quant_type_supported(static_cast<int32_t>(type)) && rows >= 0 && k > 0 && k % quant_block_values(type) == 0,
              "quant_dequantize_rows: bad type " << static_cast<int32_t>(type) << " or sizes (rows " << rows << ", k "
                                                 << k << ")");
  if (!quant_is_repacked(type)) {
    selected_quant_kernels().dequantize_rows(type, weight, rows, k, out);
    return;
  }
  std::vector<uint8_t> unpacked(static_cast<size_t>(rows) * (k / 32) * quant_block_bytes(type));
  quant_unpack_rows(type, weight, rows, k, unpacked.data());
  selected_quant_kernels().dequantize_rows(quant_file_type(type), unpacked.data(), rows, k, out);
}

bool quant_repack_x4_fits(QuantType type, int64_t rows, int32_t k) {
  return (type == QuantType::kQ4_1 || type == QuantType::kQ8_0) && rows >= 0 && rows % 4 == 0 && k > 0 &&
         k % 64 == 0;
}

namespace {

// A run of a file block's bytes and where it lands in its repacked group (QuantType's layouts).
struct LayoutPiece {
  int32_t from, bytes;  // within the file's block
  int64_t to;           // within the group's block pair (x4) or block (x8)
};

// The three pieces of a file block (d, then m and nibbles or two halves of quants) in its x4
// group's pair: block h (0 or 1) of the pair, row r of the group.

std::array<LayoutPiece, 3> x4_pieces(QuantType file_type, int r, int h) {
  const int64_t d = 2 * (4 * h + r);
  if (file_type == QuantType::kQ4_1) return {{{0, 2, d}, {2, 2, d + 16}, {4, 16, 32 + 32 * r + 16 * h}}};
  return {{{0, 2, d}, {2, 16, 16 + 64 * r + 16 * h}, {18, 16, 16 + 64 * r + 32 + 16 * h}}};
}

// src -> dst: file rows of `file_type` to its x4 layout (to_x4), or back.
void copy_x4(QuantType file_type, const uint8_t* src, int64_t rows, int32_t k, uint8_t* dst, bool to_x4) {
  VPAGE_CHECK(quant_repack_x4_fits(file_type, rows, k),
              "x4 repacking needs Q4_1 or Q8_0 rows, a multiple of 4 of them and of 64 values per row (type "
                  << static_cast<int32_t>(file_type) << ", rows " << rows << ", k " << k << ")");
  const int32_t blocks = k / 32, block_bytes = quant_block_bytes(file_type);
  const int64_t row_bytes = static_cast<int64_t>(blocks) * block_bytes;
  const int64_t pair_bytes = 8 * block_bytes;
  for (int64_t g = 0; g < rows / 4; ++g) {
    for (int32_t p = 0; p < blocks / 2; ++p) {
      const int64_t pair = (g * (blocks / 2) + p) * pair_bytes;
      for (int r = 0; r < 4; ++r) {
        for (int h = 0; h < 2; ++h) {
          const int64_t block = (4 * g + r) * row_bytes + static_cast<int64_t>(2 * p + h) * block_bytes;
          for (const LayoutPiece& piece : x4_pieces(file_type, r, h)) {
            if (to_x4) {
              std::memcpy(dst + pair + piece.to, src + block + piece.from, piece.bytes);
            } else {
              std::memcpy(dst + block + piece.from, src + pair + piece.to, piece.bytes);
            }
          }
        }
      }
    }
  }
}

// src -> dst: file rows of `file_type` to its x8 layout (to_x8), or back (QuantType's layouts:
// per block of a group, the eight d, Q4_1's eight m, then 4-byte runs of quants, row r's run j
// at 32 * j + 4 * r). A Q8_0x8 quant is the file's plus 128 (its top bit flipped).
void copy_x8(QuantType file_type, const uint8_t* src, int64_t rows, int32_t k, uint8_t* dst, bool to_x8) {
  const bool q4 = file_type == QuantType::kQ4_1;
  const int32_t blocks = k / 32, block_bytes = quant_block_bytes(file_type);
  const int32_t headers = q4 ? 2 : 1, runs = q4 ? 4 : 8;
  const int64_t row_bytes = static_cast<int64_t>(blocks) * block_bytes;
  // Bytes at file_at of the file's rows <-> group_at of the groups: an f16 (2) or a run (4, xor mask).
  auto piece = [&](int64_t file_at, int64_t group_at, int32_t bytes, uint32_t mask) {
    const int64_t from = to_x8 ? file_at : group_at, to = to_x8 ? group_at : file_at;
    uint32_t word = 0;
    std::memcpy(&word, src + from, bytes);
    word ^= mask;
    std::memcpy(dst + to, &word, bytes);
  };
  for (int64_t g = 0; g < rows / 8; ++g) {
    for (int32_t b = 0; b < blocks; ++b) {
      const int64_t group_block = (g * blocks + b) * 8 * block_bytes;
      for (int r = 0; r < 8; ++r) {
        const int64_t file_block = (8 * g + r) * row_bytes + static_cast<int64_t>(b) * block_bytes;
        for (int h = 0; h < headers; ++h) piece(file_block + 2 * h, group_block + 16 * h + 2 * r, 2, 0);
        for (int j = 0; j < runs; ++j) {
          piece(file_block + 2 * headers + 4 * j, group_block + 16 * headers + 32 * j + 4 * r, 4,
                q4 ? 0 : 0x80808080u);
        }
      }
    }
  }
}

// Whether Q8_0 rows hold a quant of -128 (bytes 2-33 of each 34-byte block).
bool has_q8_0_minimum(const uint8_t* src, int64_t rows, int32_t k) {
  const int64_t blocks = rows * (k / 32);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* q = src + b * 34 + 2;
    if (std::find(q, q + 32, uint8_t{0x80}) != q + 32) return true;
  }
  return false;
}

}  // namespace

bool quant_repack_x4(QuantType type, const uint8_t* src, int64_t rows, int32_t k, uint8_t* dst) {
  VPAGE_CHECK(quant_repack_x4_fits(type, rows, k),
              "x4 repacking needs Q4_1 or Q8_0 rows, a multiple of 4 of them and of 64 values per row (type "
                  << static_cast<int32_t>(type) << ", rows " << rows << ", k " << k << ")");
  if (type == QuantType::kQ8_0 && has_q8_0_minimum(src, rows, k)) return false;
  copy_x4(type, src, rows, k, dst, true);
  return true;
}

bool quant_repack_x8_fits(QuantType type, int64_t rows, int32_t k) {
  return (type == QuantType::kQ4_1 || type == QuantType::kQ8_0) && rows >= 0 && rows % 8 == 0 && k > 0 &&
         k % 32 == 0;
}

void quant_repack_x8(QuantType type, const uint8_t* src, int64_t rows, int32_t k, uint8_t* dst) {
  VPAGE_CHECK(quant_repack_x8_fits(type, rows, k),
              "x8 repacking needs Q4_1 or Q8_0 rows, a multiple of 8 of them (type " << static_cast<int32_t>(type)
                                                                                      << ", rows " << rows << ")");
  copy_x8(type, src, rows, k, dst, true);
}

void quant_unpack_rows(QuantType type, const uint8_t* src, int64_t rows, int32_t k, uint8_t* dst) {
  VPAGE_CHECK(quant_is_repacked(type), "quant_unpack_rows: type " << static_cast<int32_t>(type)
                                                                  << " is not an x4 or x8 type");
  if (quant_is_x4(type)) {
    copy_x4(quant_file_type(type), src, rows, k, dst, false);
  } else {
    copy_x8(quant_file_type(type), src, rows, k, dst, false);
  }
}

bool quant_reads_x8() { return selected_quant_kernels().integer_x8; }

void set_quant_integer_gemm_rows(int64_t max_rows) { gemm_max_rows.store(max_rows, std::memory_order_relaxed); }

const char* quant_matmul_isa() { return selected_quant_kernels().name; }

}  // namespace cpu
}  // namespace vpage
