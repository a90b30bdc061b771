// vpage._cuda: paged attention (decode and prefill) and its workspace size.
#include <cstddef>

#include "cuda_bindings.h"
#include "vpage/cuda/attention.h"

namespace py = pybind11;

namespace vpage::cuda_bindings {
namespace {

struct Geometry {
  int64_t num_blocks;
  int32_t num_kv_heads;
  int32_t head_size;
  int32_t block_size;
  int dtype;
};

PagedAttentionArgs make_args(int32_t num_seqs, int64_t num_query_tokens, int32_t num_heads, int32_t max_context_len,
                             const Geometry& g) {
  PagedAttentionArgs a;
  a.num_seqs = num_seqs;
  a.num_query_tokens = num_query_tokens;
  a.num_heads = num_heads;
  a.max_context_len = max_context_len;
  a.cache = CacheShape{g.num_blocks, g.num_kv_heads, g.head_size, g.block_size, to_dtype(g.dtype)};
  a.dtype = a.cache.dtype;  // the CUDA kernels take query and out in the cache's dtype
  return a;
}

cuda::AttentionVersion to_version(int version) {
  if (version < 0 || version > 3) throw py::value_error("version must be 0 (auto), 1 (v1), 2 (v2) or 3 (tiled prefill)");
  return static_cast<cuda::AttentionVersion>(version);
}

size_t workspace_bytes(int32_t num_seqs, int64_t num_query_tokens, int32_t num_heads, int32_t max_context_len,
                       bool prefill, int64_t num_blocks, int32_t num_kv_heads, int32_t head_size, int32_t block_size,
                       int dtype, int version, int32_t sliding_window) {
  PagedAttentionArgs a =
      make_args(num_seqs, num_query_tokens, num_heads, max_context_len, {num_blocks, num_kv_heads, head_size, block_size, dtype});
  a.sliding_window = sliding_window;
  static const int32_t kNonNull = 0;
  a.query_start_loc = prefill ? &kNonNull : nullptr;
  return cuda::paged_attention_workspace_bytes(a, to_version(version));
}

void paged_attention(std::uintptr_t out, std::uintptr_t query, std::uintptr_t key_cache, std::uintptr_t value_cache,
                     std::uintptr_t block_tables, std::uintptr_t context_lens, std::uintptr_t query_start_loc,
                     int32_t num_seqs, int64_t num_query_tokens, int32_t num_heads, int64_t query_stride,
                     int32_t max_blocks_per_seq, int32_t max_context_len, float scale, int64_t num_blocks,
                     int32_t num_kv_heads, int32_t head_size, int32_t block_size, int dtype, std::uintptr_t workspace,
                     size_t workspace_bytes, int version, std::uintptr_t stream, int32_t sliding_window,
                     float logits_soft_cap) {
  PagedAttentionArgs a =
      make_args(num_seqs, num_query_tokens, num_heads, max_context_len, {num_blocks, num_kv_heads, head_size, block_size, dtype});
  a.out = as_ptr<void*>(out);
  a.query = as_ptr<const void*>(query);
  a.key_cache = as_ptr<const void*>(key_cache);
  a.value_cache = as_ptr<const void*>(value_cache);
  a.block_tables = as_ptr<const int32_t*>(block_tables);
  a.context_lens = as_ptr<const int32_t*>(context_lens);
  a.query_start_loc = as_ptr<const int32_t*>(query_start_loc);
  a.max_blocks_per_seq = max_blocks_per_seq;
  a.query_stride = query_stride;
  a.scale = scale;
  a.sliding_window = sliding_window;
  a.logits_soft_cap = logits_soft_cap;
  const cuda::AttentionVersion v = to_version(version);
  void* ws = as_ptr<void*>(workspace);
  const auto s = as_ptr<cudaStream_t>(stream);
  py::gil_scoped_release release;
  if (a.query_start_loc == nullptr) {
    check(cuda::paged_attention_decode(a, ws, workspace_bytes, s, v), "paged_attention_decode");
  } else {
    check(cuda::paged_prefill_attention(a, ws, workspace_bytes, s, v), "paged_prefill_attention");
  }
}

}  // namespace

void bind_attention(py::module_& m) {
  m.attr("partition_size") = cuda::kAttentionPartitionSize;
  m.def("paged_attention_workspace_bytes", &workspace_bytes, py::arg("num_seqs"), py::arg("num_query_tokens"),
        py::arg("num_heads"), py::arg("max_context_len"), py::arg("prefill"), py::arg("num_blocks"),
        py::arg("num_kv_heads"), py::arg("head_size"), py::arg("block_size"), py::arg("dtype"), py::arg("version") = 0,
        py::arg("sliding_window") = 0,
        "Device scratch bytes paged_attention needs (0 when the one-pass v1 kernel runs).");
  m.def("paged_attention", &paged_attention, py::arg("out"), py::arg("query"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("query_start_loc"),
        py::arg("num_seqs"), py::arg("num_query_tokens"), py::arg("num_heads"), py::arg("query_stride"),
        py::arg("max_blocks_per_seq"), py::arg("max_context_len"), py::arg("scale"), py::arg("num_blocks"),
        py::arg("num_kv_heads"), py::arg("head_size"), py::arg("block_size"), py::arg("dtype"), py::arg("workspace"),
        py::arg("workspace_bytes"), py::arg("version"), py::arg("stream"), py::arg("sliding_window") = 0,
        py::arg("logits_soft_cap") = 0.0f,
        "Paged attention; decode when query_start_loc is 0, else prefill. Pointers are device addresses.\n"
        "sliding_window > 0: a query at position p sees keys (p - sliding_window, p]; logits_soft_cap > 0:\n"
        "scores s -> cap * tanh(s / cap). 0: off.");
}

}  // namespace vpage::cuda_bindings
