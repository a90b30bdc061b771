// vpage._cuda: rms_norm (with the fused residual add), rms_norm_heads, rotary_embedding,
// silu_and_mul.
#include "cuda_bindings.h"
#include "vpage/cuda/layer_ops.h"

namespace py = pybind11;

namespace vpage::cuda_bindings {

void bind_layer_ops(py::module_& m) {
  m.def(
      "rms_norm",
      [](std::uintptr_t out, int64_t out_stride, std::uintptr_t input, int64_t input_stride, std::uintptr_t residual,
         std::uintptr_t weight, int64_t rows, int32_t cols, float epsilon, int dtype, std::uintptr_t stream) {
        const DType t = to_dtype(dtype);
        py::gil_scoped_release release;
        check(cuda::rms_norm(as_ptr<void*>(out), out_stride, as_ptr<void*>(input), input_stride,
                             as_ptr<void*>(residual), as_ptr<const void*>(weight), rows, cols, epsilon, t,
                             as_ptr<cudaStream_t>(stream)),
              "rms_norm");
      },
      py::arg("out"), py::arg("out_stride"), py::arg("input"), py::arg("input_stride"), py::arg("residual"),
      py::arg("weight"), py::arg("rows"), py::arg("cols"), py::arg("epsilon"), py::arg("dtype"), py::arg("stream"),
      "RMS norm of rows; residual != 0: residual += input first and input gets the norm (out == input).");
  m.def(
      "rms_norm_heads",
      [](std::uintptr_t x, int64_t tokens, int64_t row_stride, int32_t num_heads, int32_t head_size,
         std::uintptr_t weight, float epsilon, int dtype, std::uintptr_t stream) {
        const DType t = to_dtype(dtype);
        py::gil_scoped_release release;
        check(cuda::rms_norm_heads(as_ptr<void*>(x), tokens, row_stride, num_heads, head_size,
                                   as_ptr<const void*>(weight), epsilon, t, as_ptr<cudaStream_t>(stream)),
              "rms_norm_heads");
      },
      py::arg("x"), py::arg("tokens"), py::arg("row_stride"), py::arg("num_heads"), py::arg("head_size"),
      py::arg("weight"), py::arg("epsilon"), py::arg("dtype"), py::arg("stream"),
      "In place RMS norm of each of the first num_heads heads of every row.");
  m.def(
      "rotary_embedding",
      [](std::uintptr_t x, int64_t tokens, int64_t row_stride, std::uintptr_t positions, std::uintptr_t cos_sin,
         int32_t num_heads, int32_t head_size, int32_t rotary_dim, int dtype, std::uintptr_t stream) {
        const DType t = to_dtype(dtype);
        py::gil_scoped_release release;
        check(cuda::rotary_embedding(as_ptr<void*>(x), tokens, row_stride, as_ptr<const int64_t*>(positions),
                                     as_ptr<const float*>(cos_sin), num_heads, head_size, rotary_dim, t,
                                     as_ptr<cudaStream_t>(stream)),
              "rotary_embedding");
      },
      py::arg("x"), py::arg("tokens"), py::arg("row_stride"), py::arg("positions"), py::arg("cos_sin"),
      py::arg("num_heads"), py::arg("head_size"), py::arg("rotary_dim"), py::arg("dtype"), py::arg("stream"),
      "In place rotate-half rotary embedding of the first num_heads heads of every row.");
  m.def(
      "silu_and_mul",
      [](std::uintptr_t out, int64_t out_stride, std::uintptr_t input, int64_t input_stride, int64_t tokens,
         int32_t d, int dtype, std::uintptr_t stream) {
        const DType t = to_dtype(dtype);
        py::gil_scoped_release release;
        check(cuda::silu_and_mul(as_ptr<void*>(out), out_stride, as_ptr<const void*>(input), input_stride, tokens,
                                 d, t, as_ptr<cudaStream_t>(stream)),
              "silu_and_mul");
      },
      py::arg("out"), py::arg("out_stride"), py::arg("input"), py::arg("input_stride"), py::arg("tokens"),
      py::arg("d"), py::arg("dtype"), py::arg("stream"), "out = silu(input[:, :d]) * input[:, d:].");
}

}  // namespace vpage::cuda_bindings
