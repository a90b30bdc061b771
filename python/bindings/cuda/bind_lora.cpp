// vpage._cuda: lora_add (batched multi-LoRA: each row's adapter slot, Punica's BGMV).
#include <vector>

#include <pybind11/stl.h>

#include "cuda_bindings.h"
#include "vpage/cuda/lora.h"

namespace py = pybind11;

namespace vpage::cuda_bindings {
namespace {

void lora_add(std::uintptr_t out, std::uintptr_t x, std::uintptr_t token_slots, std::uintptr_t table, int64_t m,
              int32_t k, int64_t x_stride, int64_t out_stride, int32_t num_slots, const std::vector<int32_t>& slice_rows,
              int32_t max_rank, int dtype, int weight_dtype, std::uintptr_t workspace, std::size_t workspace_bytes,
              std::uintptr_t stream) {
  if (slice_rows.empty() || slice_rows.size() > static_cast<size_t>(kMaxLoraSlices))
    throw py::value_error("slice_rows must hold 1 to 3 sizes");
  LoraArgs a;
  a.out = as_ptr<void*>(out);
  a.x = as_ptr<const void*>(x);
  a.m = m;
  a.k = k;
  a.x_stride = x_stride;
  a.out_stride = out_stride;
  a.token_slots = as_ptr<const int32_t*>(token_slots);
  a.slots = as_ptr<const LoraAdapterWeights*>(table);
  a.num_slots = num_slots;
  a.num_slices = static_cast<int32_t>(slice_rows.size());
  for (size_t j = 0; j < slice_rows.size(); ++j) a.slice_rows[j] = slice_rows[j];
  a.dtype = to_dtype(dtype);
  a.weight_dtype = to_dtype(weight_dtype);
  py::gil_scoped_release release;
  check(cuda::lora_add(a, max_rank, as_ptr<void*>(workspace), workspace_bytes, as_ptr<cudaStream_t>(stream)),
        "lora_add");
}

}  // namespace

void bind_lora(py::module_& m) {
  m.def("lora_add_workspace_bytes", &cuda::lora_add_workspace_bytes, py::arg("m"), py::arg("num_slices"),
        py::arg("max_rank"), "Bytes of device workspace lora_add needs for these sizes.");
  m.def("lora_add", &lora_add, py::arg("out"), py::arg("x"), py::arg("token_slots"), py::arg("table"), py::arg("m"),
        py::arg("k"), py::arg("x_stride"), py::arg("out_stride"), py::arg("num_slots"), py::arg("slice_rows"),
        py::arg("max_rank"), py::arg("dtype"), py::arg("weight_dtype"), py::arg("workspace"),
        py::arg("workspace_bytes"), py::arg("stream"),
        "out [m, sum(slice_rows)] += each row's LoRA adapter on x [m, k] (vpage/cuda/lora.h); token_slots\n"
        "int32 [m] (-1: none), table int64 [num_slots, 5] (a, b0, b1, b2, rank) of device pointers to\n"
        "row-major weights of weight_dtype, every rank <= max_rank.");
}

}  // namespace vpage::cuda_bindings
