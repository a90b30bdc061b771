// vpage._core dense (packed float weight) matmul kernels: private raw-pointer entry points
// (underscore names) for vpage.ops.pack_dense_weight / dense_matmul / lora_add, which check the
// tensors first. The kernels still check dtypes and sizes and throw ValueError.
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings.h"
#include "vpage/kernels/dense_matmul.h"
#include "vpage/kernels/lora.h"

namespace py = pybind11;

namespace vpage::bindings {

void bind_dense(py::module_& m) {
  m.def(
      "_cpu_dense_pack",
      [](uintptr_t packed, uintptr_t weight, int32_t n, int32_t k, int64_t w_stride, int32_t dtype,
         int num_threads) {
        py::gil_scoped_release release;
        cpu::dense_pack(static_cast<DType>(dtype), reinterpret_cast<const void*>(weight), n, k, w_stride,
                        reinterpret_cast<void*>(packed), num_threads);
      },
      py::arg("packed"), py::arg("weight"), py::arg("n"), py::arg("k"), py::arg("w_stride"), py::arg("dtype"),
      py::arg("num_threads"),
      "Packs W [n, k] (row stride w_stride) into packed [ceil(n / 32), k, 32], zeros past row n.");
  m.def(
      "_cpu_dense_matmul",
      [](uintptr_t out, uintptr_t x, uintptr_t weight, uintptr_t bias, int64_t rows, int32_t n, int32_t k,
         int64_t x_stride, int64_t out_stride, int32_t dtype, int32_t weight_dtype, bool float32_out,
         int num_threads) {
        DenseMatmulArgs args;
        args.out = reinterpret_cast<void*>(out);
        args.x = reinterpret_cast<const void*>(x);
        args.weight = reinterpret_cast<const void*>(weight);
        args.bias = reinterpret_cast<const float*>(bias);
        args.m = rows;
        args.n = n;
        args.k = k;
        args.x_stride = x_stride;
        args.out_stride = out_stride;
        args.dtype = static_cast<DType>(dtype);
        args.weight_dtype = static_cast<DType>(weight_dtype);
        args.float32_out = float32_out;
        py::gil_scoped_release release;
        cpu::dense_matmul(args, num_threads);
      },
      py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("m"), py::arg("n"), py::arg("k"),
      py::arg("x_stride"), py::arg("out_stride"), py::arg("dtype"), py::arg("weight_dtype"), py::arg("float32_out"),
      py::arg("num_threads"),
      "out [m, n] = x [m, k] @ W^T (+ bias, float32 [n] or 0), W packed by _cpu_dense_pack; out in x's\n"
      "dtype, or float32 when float32_out. dtype codes: 0 float32, 1 float16, 2 bfloat16; strides in\n"
      "elements.");
  m.def(
      "_cpu_lora_add",
      [](uintptr_t out, uintptr_t x, uintptr_t token_slots, uintptr_t slots, int64_t rows, int32_t k,
         int64_t x_stride, int64_t out_stride, int32_t num_slots, const std::vector<int32_t>& slice_rows,
         int32_t dtype, int32_t weight_dtype, int num_threads) {
        if (slice_rows.empty() || slice_rows.size() > static_cast<size_t>(kMaxLoraSlices)) {
          throw py::value_error("_cpu_lora_add: 1 to " + std::to_string(kMaxLoraSlices) + " slices, got " +
                                std::to_string(slice_rows.size()));
        }
        LoraArgs args;
        args.out = ptr<void>(out);
        args.x = ptr<const void>(x);
        args.m = rows;
        args.k = k;
        args.x_stride = x_stride;
        args.out_stride = out_stride;
        args.token_slots = ptr<const int32_t>(token_slots);
        args.slots = ptr<const LoraAdapterWeights>(slots);
        args.num_slots = num_slots;
        args.num_slices = static_cast<int32_t>(slice_rows.size());
        for (size_t j = 0; j < slice_rows.size(); ++j) args.slice_rows[j] = slice_rows[j];
        args.dtype = static_cast<DType>(dtype);
        args.weight_dtype = static_cast<DType>(weight_dtype);
        py::gil_scoped_release release;
        cpu::lora_add(args, num_threads);
      },
      py::arg("out"), py::arg("x"), py::arg("token_slots"), py::arg("slots"), py::arg("m"), py::arg("k"),
      py::arg("x_stride"), py::arg("out_stride"), py::arg("num_slots"), py::arg("slice_rows"), py::arg("dtype"),
      py::arg("weight_dtype"), py::arg("num_threads"),
      "out [m, sum(slice_rows)] += each row's LoRA adapter applied to x [m, k] (both of dtype `dtype`):\n"
      "token_slots int32 [m] (-1 = none), slots int64 [num_slots, 5] rows (a, b0, b1, b2, rank) of\n"
      "pointers to weights packed by _cpu_dense_pack in weight_dtype (0 = none). Strides in elements.");
  m.attr("DENSE_PANEL_ROWS") = kDensePanelRows;
  m.def("dense_matmul_isa", &cpu::dense_matmul_isa,
        "Instruction set level of the dense matmul (follows set_cpu_isa: avx512, avx2 or generic).");
}

}  // namespace vpage::bindings
