// vpage._core CPU kernel functions: flat wrappers over vpage::cpu taking data pointers as
// Python ints (tensor.data_ptr()), sizes, strides and a dtype code. vpage.ops checks the
// tensors first; the kernels still check sizes and indices and throw ValueError.
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "bindings.h"
#include "vpage/kernels/cpu_kernels.h"
#include "vpage/kernels/layer_ops.h"
#include "vpage/kernels/rotary.h"
#include "vpage/kernels/sampler_ops.h"
#include "vpage/kernels/token_bitmask.h"

namespace py = pybind11;

namespace vpage::bindings {
namespace {

CacheShape cache_shape(int64_t num_blocks, int32_t num_kv_heads, int32_t head_size, int32_t block_size,
                       int32_t dtype) {
  return CacheShape{num_blocks, num_kv_heads, head_size, block_size, static_cast<DType>(dtype)};
}

}  // namespace

void bind_cpu_kernels(py::module_& m) {
  m.def(
      "_cpu_rms_norm",
      [](uintptr_t out, uintptr_t x, uintptr_t residual, uintptr_t weight, int64_t num_tokens, int32_t hidden_size,
         float eps, int32_t dtype, int num_threads) {
        RmsNormArgs args;
        args.out = ptr<void>(out);
        args.x = ptr<const void>(x);
        args.residual = ptr<void>(residual);
        args.weight = ptr<const void>(weight);
        args.num_tokens = num_tokens;
        args.hidden_size = hidden_size;
        args.eps = eps;
        args.dtype = static_cast<DType>(dtype);
        py::gil_scoped_release release;
        cpu::rms_norm(args, num_threads);
      },
      py::arg("out"), py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("num_tokens"),
      py::arg("hidden_size"), py::arg("eps"), py::arg("dtype"), py::arg("num_threads"),
      "out = rms_norm(x) * weight per row; with residual != 0: residual += x first, then out =\n"
      "rms_norm(residual) * weight. Contiguous rows; out may be x.");
  m.def(
      "_cpu_sigmoid_gated_add",
      [](uintptr_t out, uintptr_t y, uintptr_t gate, int64_t num_tokens, int32_t d, int32_t dtype, int num_threads) {
        SigmoidGatedAddArgs args;
        args.out = ptr<void>(out);
        args.y = ptr<const void>(y);
        args.gate = ptr<const void>(gate);
        args.num_tokens = num_tokens;
        args.d = d;
        args.dtype = static_cast<DType>(dtype);
        py::gil_scoped_release release;
        cpu::sigmoid_gated_add(args, num_threads);
      },
      py::arg("out"), py::arg("y"), py::arg("gate"), py::arg("num_tokens"), py::arg("d"), py::arg("dtype"),
      py::arg("num_threads"),
      "In place: out [num_tokens, d] += sigmoid(gate [num_tokens]) * y [num_tokens, d], contiguous rows.");
  m.def(
      "_cpu_silu_and_mul",
      [](uintptr_t out, uintptr_t x, int64_t num_tokens, int32_t d, int32_t dtype, int num_threads) {
        SiluAndMulArgs args;
        args.out = ptr<void>(out);
        args.x = ptr<const void>(x);
        args.num_tokens = num_tokens;
        args.d = d;
        args.dtype = static_cast<DType>(dtype);
        py::gil_scoped_release release;
        cpu::silu_and_mul(args, num_threads);
      },
      py::arg("out"), py::arg("x"), py::arg("num_tokens"), py::arg("d"), py::arg("dtype"), py::arg("num_threads"),
      "out [num_tokens, d] = silu(x[:, :d]) * x[:, d:] for contiguous x [num_tokens, 2 d].");
  m.def(
      "_cpu_gelu_tanh_and_mul",
      [](uintptr_t out, uintptr_t x, int64_t num_tokens, int32_t d, int32_t dtype, int num_threads) {
        GeluTanhAndMulArgs args;
        args.out = ptr<void>(out);
        args.x = ptr<const void>(x);
        args.num_tokens = num_tokens;
        args.d = d;
        args.dtype = static_cast<DType>(dtype);
        py::gil_scoped_release release;
        cpu::gelu_tanh_and_mul(args, num_threads);
      },
      py::arg("out"), py::arg("x"), py::arg("num_tokens"), py::arg("d"), py::arg("dtype"), py::arg("num_threads"),
      "out [num_tokens, d] = gelu_tanh(x[:, :d]) * x[:, d:] for contiguous x [num_tokens, 2 d].");
  m.def(
      "_cpu_rms_norm_heads",
      [](uintptr_t x, int64_t row_stride, uintptr_t weight, int64_t num_tokens, int32_t num_heads, int32_t head_size,
         float eps, int32_t dtype, int num_threads) {
        RmsNormHeadsArgs args;
        args.x = ptr<void>(x);
        args.row_stride = row_stride;
        args.weight = ptr<const void>(weight);
        args.num_tokens = num_tokens;
        args.num_heads = num_heads;
        args.head_size = head_size;
        args.eps = eps;
        args.dtype = static_cast<DType>(dtype);
        py::gil_scoped_release release;
        cpu::rms_norm_heads(args, num_threads);
      },
      py::arg("x"), py::arg("row_stride"), py::arg("weight"), py::arg("num_tokens"), py::arg("num_heads"),
      py::arg("head_size"), py::arg("eps"), py::arg("dtype"), py::arg("num_threads"),
      "In place: each of the first num_heads heads of every row of x (rows row_stride apart) becomes\n"
      "rms_norm(head) * weight, weight [head_size].");
  m.def(
      "_cpu_logsumexp_argmax",
      [](uintptr_t logits, int64_t num_rows, int64_t vocab, int64_t row_stride, uintptr_t log_norm,
         uintptr_t argmax, uintptr_t want_log_norm, int num_threads, uintptr_t bitmask, int64_t bitmask_stride) {
        LogsumexpArgmaxArgs args;
        args.logits = ptr<const float>(logits);
        args.num_rows = num_rows;
        args.vocab = vocab;
        args.row_stride = row_stride;
        args.log_norm = ptr<float>(log_norm);
        args.argmax = ptr<int64_t>(argmax);
        args.want_log_norm = ptr<const uint8_t>(want_log_norm);
        args.bitmask = ptr<const int32_t>(bitmask);
        args.bitmask_stride = bitmask_stride;
        py::gil_scoped_release release;
        cpu::logsumexp_argmax(args, num_threads);
      },
      py::arg("logits"), py::arg("num_rows"), py::arg("vocab"), py::arg("row_stride"), py::arg("log_norm"),
      py::arg("argmax"), py::arg("want_log_norm"), py::arg("num_threads"), py::arg("bitmask") = 0,
      py::arg("bitmask_stride") = 0,
      "Per row of float32 logits [num_rows, vocab] (rows row_stride apart): log_norm (float32) =\n"
      "logsumexp (NaN for rows whose uint8 want_log_norm entry is 0; 0 pointer: every row),\n"
      "argmax (int64) = index of the first maximum, as torch.argmax; with an int32 token bitmask\n"
      "[num_rows, bitmask_stride] (0: none) the argmax is over the allowed tokens only.");
  m.def(
      "_cpu_apply_token_bitmask",
      [](uintptr_t logits, int64_t num_rows, int64_t vocab, int64_t row_stride, uintptr_t bitmask,
         int64_t bitmask_stride, int num_threads) {
        TokenBitmaskArgs args;
        args.logits = ptr<float>(logits);
        args.num_rows = num_rows;
        args.vocab = vocab;
        args.row_stride = row_stride;
        args.bitmask = ptr<const int32_t>(bitmask);
        args.bitmask_stride = bitmask_stride;
        py::gil_scoped_release release;
        cpu::apply_token_bitmask(args, num_threads);
      },
      py::arg("logits"), py::arg("num_rows"), py::arg("vocab"), py::arg("row_stride"), py::arg("bitmask"),
      py::arg("bitmask_stride"), py::arg("num_threads"),
      "In place: -inf in float32 logits [num_rows, vocab] (rows row_stride apart) wherever the int32\n"
      "token bitmask [num_rows, bitmask_stride] has a 0 bit (bit t % 32 of word t / 32: token t).");
  m.def(
      "_cpu_rotary_embedding",
      [](uintptr_t x, int64_t row_stride, uintptr_t positions, uintptr_t cos_sin, int64_t max_position,
         int64_t num_tokens, int32_t num_heads, int32_t head_size, int32_t dtype, int num_threads,
         int32_t rotary_dim) {
        RotaryArgs args;
        args.x = ptr<void>(x);
        args.row_stride = row_stride;
        args.positions = ptr<const int64_t>(positions);
        args.cos_sin = ptr<const float>(cos_sin);
        args.max_position = max_position;
        args.num_tokens = num_tokens;
        args.num_heads = num_heads;
        args.head_size = head_size;
        args.rotary_dim = rotary_dim;
        args.dtype = static_cast<DType>(dtype);
        py::gil_scoped_release release;
        cpu::rotary_embedding(args, num_threads);
      },
      py::arg("x"), py::arg("row_stride"), py::arg("positions"), py::arg("cos_sin"), py::arg("max_position"),
      py::arg("num_tokens"), py::arg("num_heads"), py::arg("head_size"), py::arg("dtype"), py::arg("num_threads"),
      py::arg("rotary_dim") = 0,
      "Rotates the first rotary_dim (0: head_size) elements of the first num_heads heads of each row\n"
      "of x in place (rotate-half convention), with cos/sin rows of the float32 cos_sin table\n"
      "[max_position, rotary_dim] at int64 positions.");

  m.def(
      "_cpu_reshape_and_cache",
      [](uintptr_t key, uintptr_t value, uintptr_t key_cache, uintptr_t value_cache, uintptr_t slot_mapping,
         int64_t num_tokens, int64_t key_stride, int64_t value_stride, int64_t num_blocks, int32_t num_kv_heads,
         int32_t head_size, int32_t block_size, int32_t dtype, int32_t cache_dtype, int num_threads) {
        ReshapeAndCacheArgs args;
        args.key = ptr<const void>(key);
        args.value = ptr<const void>(value);
        args.key_cache = ptr<void>(key_cache);
        args.value_cache = ptr<void>(value_cache);
        args.slot_mapping = ptr<const int64_t>(slot_mapping);
        args.num_tokens = num_tokens;
        args.key_stride = key_stride;
        args.value_stride = value_stride;
        args.dtype = static_cast<DType>(dtype);
        args.cache = cache_shape(num_blocks, num_kv_heads, head_size, block_size, cache_dtype);
        py::gil_scoped_release release;
        cpu::reshape_and_cache(args, num_threads);
      },
      py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
      py::arg("num_tokens"), py::arg("key_stride"), py::arg("value_stride"), py::arg("num_blocks"),
      py::arg("num_kv_heads"), py::arg("head_size"), py::arg("block_size"), py::arg("dtype"),
      py::arg("cache_dtype"), py::arg("num_threads"),
      "Writes key/value rows [num_tokens, num_kv_heads, head_size] (row strides in elements) into\n"
      "their cache slots (int64 slot_mapping, slot < 0 skipped). Pointers are data_ptr() ints;\n"
      "dtype (of key/value) and cache_dtype: 0 float32, 1 float16, 2 bfloat16; float32 rows are\n"
      "rounded into a 16-bit cache.");

  m.def(
      "_cpu_paged_attention",
      [](uintptr_t out, uintptr_t query, uintptr_t key_cache, uintptr_t value_cache, uintptr_t block_tables,
         uintptr_t context_lens, uintptr_t query_start_loc, int32_t num_seqs, int64_t num_query_tokens,
         int32_t num_heads, int32_t max_blocks_per_seq, int32_t max_context_len, int64_t query_stride, float scale,
         int64_t num_blocks, int32_t num_kv_heads, int32_t head_size, int32_t block_size, int32_t dtype,
         int32_t cache_dtype, int num_threads, int32_t sliding_window, float logits_soft_cap,
         bool draft_queries) {
        PagedAttentionArgs args;
        args.out = ptr<void>(out);
        args.query = ptr<const void>(query);
        args.key_cache = ptr<const void>(key_cache);
        args.value_cache = ptr<const void>(value_cache);
        args.block_tables = ptr<const int32_t>(block_tables);
        args.context_lens = ptr<const int32_t>(context_lens);
        args.query_start_loc = ptr<const int32_t>(query_start_loc);
        args.num_seqs = num_seqs;
        args.num_query_tokens = num_query_tokens;
        args.num_heads = num_heads;
        args.max_blocks_per_seq = max_blocks_per_seq;
        args.max_context_len = max_context_len;
        args.query_stride = query_stride;
        args.scale = scale;
        args.dtype = static_cast<DType>(dtype);
        args.cache = cache_shape(num_blocks, num_kv_heads, head_size, block_size, cache_dtype);
        args.sliding_window = sliding_window;
        args.logits_soft_cap = logits_soft_cap;
        args.draft_queries = draft_queries;
        py::gil_scoped_release release;
        cpu::paged_attention(args, num_threads);
      },
      py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
      py::arg("context_lens"), py::arg("query_start_loc"), py::arg("num_seqs"), py::arg("num_query_tokens"),
      py::arg("num_heads"), py::arg("max_blocks_per_seq"), py::arg("max_context_len"), py::arg("query_stride"),
      py::arg("scale"), py::arg("num_blocks"), py::arg("num_kv_heads"), py::arg("head_size"),
      py::arg("block_size"), py::arg("dtype"), py::arg("cache_dtype"), py::arg("num_threads"),
      py::arg("sliding_window") = 0, py::arg("logits_soft_cap") = 0.0f, py::arg("draft_queries") = false,
      "Paged attention into out [num_query_tokens, num_heads, head_size] (contiguous; dtype: of query\n"
      "and out, cache_dtype: of the caches). query_start_loc\n"
      "= 0 means decode (one query per sequence); else int32 [num_seqs + 1] for causal prefill.\n"
      "block_tables int32 [num_seqs, max_blocks_per_seq], context_lens int32 [num_seqs].\n"
      "sliding_window > 0: a query at position p sees keys (p - sliding_window, p] (blocks wholly\n"
      "before the window are not read); logits_soft_cap > 0: scores s -> cap * tanh(s / cap). 0: off.\n"
      "draft_queries (prefill): each sequence's rows are a decode token and its drafts, scored by the\n"
      "decode kernel as decode steps at their positions would be.");

  m.def(
      "_cpu_packed_attention",
      [](uintptr_t out, uintptr_t query, uintptr_t key, uintptr_t value, uintptr_t seq_info, int32_t num_seqs,
         int64_t num_query_rows, int64_t num_kv_rows, int32_t num_heads, int32_t head_size, int64_t query_stride,
         int64_t key_stride, int64_t value_stride, int64_t out_stride, float scale, int32_t window, int32_t dtype,
         int num_threads) {
        PackedAttentionArgs args;
        const int32_t* info = ptr<const int32_t>(seq_info);
        args.out = ptr<void>(out);
        args.query = ptr<const void>(query);
        args.key = ptr<const void>(key);
        args.value = ptr<const void>(value);
        args.kv_starts = info;
        args.kv_lens = info + num_seqs;
        args.q_starts = info + 2 * static_cast<int64_t>(num_seqs);
        args.q_lens = info + 3 * static_cast<int64_t>(num_seqs);
        args.q_offsets = info + 4 * static_cast<int64_t>(num_seqs);
        args.num_seqs = num_seqs;
        args.num_query_rows = num_query_rows;
        args.num_kv_rows = num_kv_rows;
        args.num_heads = num_heads;
        args.head_size = head_size;
        args.query_stride = query_stride;
        args.key_stride = key_stride;
        args.value_stride = value_stride;
        args.out_stride = out_stride;
        args.scale = scale;
        args.window = window;
        args.dtype = static_cast<DType>(dtype);
        py::gil_scoped_release release;
        cpu::packed_attention(args, num_threads);
      },
      py::arg("out"), py::arg("query"), py::arg("key"), py::arg("value"), py::arg("seq_info"), py::arg("num_seqs"),
      py::arg("num_query_rows"), py::arg("num_kv_rows"), py::arg("num_heads"), py::arg("head_size"),
      py::arg("query_stride"), py::arg("key_stride"), py::arg("value_stride"), py::arg("out_stride"),
      py::arg("scale"), py::arg("window"), py::arg("dtype"), py::arg("num_threads"),
      "Bidirectional attention over packed sequences (encoders). seq_info: contiguous int32\n"
      "[5, num_seqs] = key/value start rows, lengths, query start rows, query counts, position of\n"
      "each sequence's first query. Rows [*, num_heads, head_size] with the given row strides\n"
      "(elements), one dtype (0 float32, 1 float16, 2 bfloat16). window > 0: a query at position p\n"
      "sees keys at [p - window, p + window]; 0: all of its sequence.");

  m.def(
      "_cpu_copy_blocks",
      [](const std::vector<uintptr_t>& key_caches, const std::vector<uintptr_t>& value_caches,
         uintptr_t block_mapping, int64_t num_pairs, int64_t num_blocks, int32_t num_kv_heads, int32_t head_size,
         int32_t block_size, int32_t cache_dtype, int num_threads) {
        if (key_caches.size() != value_caches.size()) {
          throw py::value_error("_cpu_copy_blocks: key_caches and value_caches differ in length");
        }
        std::vector<void*> keys, values;
        for (uintptr_t p : key_caches) keys.push_back(ptr<void>(p));
        for (uintptr_t p : value_caches) values.push_back(ptr<void>(p));
        CopyBlocksArgs args;
        args.key_caches = keys.data();
        args.value_caches = values.data();
        args.num_layers = static_cast<int32_t>(keys.size());
        args.block_mapping = ptr<const int64_t>(block_mapping);
        args.num_pairs = num_pairs;
        args.cache = cache_shape(num_blocks, num_kv_heads, head_size, block_size, cache_dtype);
        py::gil_scoped_release release;
        cpu::copy_blocks(args, num_threads);
      },
      py::arg("key_caches"), py::arg("value_caches"), py::arg("block_mapping"), py::arg("num_pairs"),
      py::arg("num_blocks"), py::arg("num_kv_heads"), py::arg("head_size"), py::arg("block_size"),
      py::arg("cache_dtype"), py::arg("num_threads"),
      "Copies blocks (int64 block_mapping [num_pairs, 2] of (src, dst)) within every layer's key and\n"
      "value cache; key_caches/value_caches are lists of data_ptr() ints of one cache shape.");

  m.def(
      "_cpu_swap_blocks",
      [](uintptr_t src, uintptr_t dst, int64_t block_bytes, uintptr_t block_mapping, int64_t num_pairs,
         int64_t src_num_blocks, int64_t dst_num_blocks, int num_threads) {
        SwapBlocksArgs args;
        args.src = ptr<const void>(src);
        args.dst = ptr<void>(dst);
        args.block_bytes = block_bytes;
        args.block_mapping = ptr<const int64_t>(block_mapping);
        args.num_pairs = num_pairs;
        args.src_num_blocks = src_num_blocks;
        args.dst_num_blocks = dst_num_blocks;
        py::gil_scoped_release release;
        cpu::swap_blocks(args, num_threads);
      },
      py::arg("src"), py::arg("dst"), py::arg("block_bytes"), py::arg("block_mapping"), py::arg("num_pairs"),
      py::arg("src_num_blocks"), py::arg("dst_num_blocks"), py::arg("num_threads"),
      "Copies whole blocks of block_bytes bytes from src to dst (int64 block_mapping [num_pairs, 2]).");

  m.def("set_thread_source", &cpu::set_thread_source, py::arg("source"),
        "Threads of the CPU kernels: 'own' pool or the loaded 'openmp' runtime (torch's); returns the "
        "runtime's file name in use, '' for the own pool.");
  m.def("cpu_isa", &cpu::cpu_isa,
        "Instruction set level of the CPU kernels: avx512vnni, avx512, avx2vnni, avx2 or generic.");
  m.def("set_cpu_isa", &cpu::set_cpu_isa, py::arg("isa"),
        "Restricts the CPU kernels to one of cpu_isa's levels or 'auto' (tests, benchmarks).");
}

}  // namespace vpage::bindings
