// vpage._cuda: thin pybind11 layer over the CUDA launchers (no libtorch). Launches release
// the GIL; a failed launch raises RuntimeError with the CUDA error string.
#include <stdexcept>
#include <string>

#include "cuda_bindings.h"

namespace py = pybind11;

namespace vpage::cuda_bindings {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

DType to_dtype(int code) {
  if (code < 0 || code > 2) throw py::value_error("dtype code must be 0 (f32), 1 (f16) or 2 (bf16)");
  return static_cast<DType>(code);
}

namespace {

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace

void bind_device(py::module_& m) {
  m.def("device_count", &device_count,
        "Number of visible CUDA devices; 0 (no exception) when there is no driver or device.");
  m.def("is_available", [] { return device_count() > 0; },
        "True when a CUDA driver and at least one device are present.");
  m.def("synchronize", [](std::uintptr_t stream) { check(cudaStreamSynchronize(as_ptr<cudaStream_t>(stream)), "synchronize"); },
        py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        "Blocks until the work queued on `stream` has finished.");
}

}  // namespace vpage::cuda_bindings

PYBIND11_MODULE(_cuda, m) {
  m.doc() =
      "vpage CUDA kernels: paged attention, reshape_and_cache, copy_blocks, swap_blocks, apply_token_bitmask, "
      "fused_moe, rms_norm, rotary_embedding, silu_and_mul, lora_add";
  vpage::cuda_bindings::bind_device(m);
  vpage::cuda_bindings::bind_attention(m);
  vpage::cuda_bindings::bind_cache_ops(m);
  vpage::cuda_bindings::bind_token_bitmask(m);
  vpage::cuda_bindings::bind_moe(m);
  vpage::cuda_bindings::bind_layer_ops(m);
  vpage::cuda_bindings::bind_lora(m);
}
