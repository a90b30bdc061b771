// vpage._cuda: reshape_and_cache, copy_blocks and swap_blocks.
#include "cuda_bindings.h"
#include "vpage/cuda/cache_ops.h"
#include "vpage/cuda/swap.h"

namespace py = pybind11;

namespace vpage::cuda_bindings {
namespace {

void reshape_and_cache(std::uintptr_t key, std::uintptr_t value, std::uintptr_t key_cache, std::uintptr_t value_cache,
                       std::uintptr_t slot_mapping, int64_t num_tokens, int64_t key_stride, int64_t value_stride,
                       int64_t num_blocks, int32_t num_kv_heads, int32_t head_size, int32_t block_size, int dtype,
                       std::uintptr_t stream) {
  ReshapeAndCacheArgs a;
  a.key = as_ptr<const void*>(key);
  a.value = as_ptr<const void*>(value);
  a.key_cache = as_ptr<void*>(key_cache);
  a.value_cache = as_ptr<void*>(value_cache);
  a.slot_mapping = as_ptr<const int64_t*>(slot_mapping);
  a.num_tokens = num_tokens;
  a.key_stride = key_stride;
  a.value_stride = value_stride;
  a.cache = CacheShape{num_blocks, num_kv_heads, head_size, block_size, to_dtype(dtype)};
  a.dtype = a.cache.dtype;  // the CUDA kernel writes key/value of the cache's dtype
  py::gil_scoped_release release;
  check(cuda::reshape_and_cache(a, as_ptr<cudaStream_t>(stream)), "reshape_and_cache");
}

void copy_blocks(std::uintptr_t key_caches, std::uintptr_t value_caches, int32_t num_layers,
                 std::uintptr_t block_mapping, int64_t num_pairs, int64_t num_blocks, int32_t num_kv_heads,
                 int32_t head_size, int32_t block_size, int dtype, std::uintptr_t stream) {
  CopyBlocksArgs a;
  a.key_caches = as_ptr<void* const*>(key_caches);
  a.value_caches = as_ptr<void* const*>(value_caches);
  a.num_layers = num_layers;
  a.block_mapping = as_ptr<const int64_t*>(block_mapping);
  a.num_pairs = num_pairs;
  a.cache = CacheShape{num_blocks, num_kv_heads, head_size, block_size, to_dtype(dtype)};
  py::gil_scoped_release release;
  check(cuda::copy_blocks(a, as_ptr<cudaStream_t>(stream)), "copy_blocks");
}

void swap_blocks(std::uintptr_t src, std::uintptr_t dst, int64_t block_bytes, std::uintptr_t block_mapping,
                 int64_t num_pairs, std::uintptr_t stream) {
  SwapBlocksArgs a;
  a.src = as_ptr<const void*>(src);
  a.dst = as_ptr<void*>(dst);
  a.block_bytes = block_bytes;
  a.block_mapping = as_ptr<const int64_t*>(block_mapping);
  a.num_pairs = num_pairs;
  py::gil_scoped_release release;
  check(cuda::swap_blocks(a, as_ptr<cudaStream_t>(stream)), "swap_blocks");
}

}  // namespace

void bind_cache_ops(py::module_& m) {
  m.def("reshape_and_cache", &reshape_and_cache, py::arg("key"), py::arg("value"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("slot_mapping"), py::arg("num_tokens"), py::arg("key_stride"),
        py::arg("value_stride"), py::arg("num_blocks"), py::arg("num_kv_heads"), py::arg("head_size"),
        py::arg("block_size"), py::arg("dtype"), py::arg("stream"),
        "Writes new K/V rows into their cache slots (int64 slot_mapping; slot < 0 skips).");
  m.def("copy_blocks", &copy_blocks, py::arg("key_caches"), py::arg("value_caches"), py::arg("num_layers"),
        py::arg("block_mapping"), py::arg("num_pairs"), py::arg("num_blocks"), py::arg("num_kv_heads"),
        py::arg("head_size"), py::arg("block_size"), py::arg("dtype"), py::arg("stream"),
        "Copies blocks src -> dst in every layer; pointer arrays and int64 [num_pairs, 2] mapping on the device.");
  m.def("swap_blocks", &swap_blocks, py::arg("src"), py::arg("dst"), py::arg("block_bytes"), py::arg("block_mapping"),
        py::arg("num_pairs"), py::arg("stream"),
        "Async block copies between pools (device <-> pinned host); block_mapping is host int64 [num_pairs, 2].");
}

}  // namespace vpage::cuda_bindings
