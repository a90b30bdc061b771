// vpage._core quantized-weight kernels: private raw-pointer entry points (underscore names)
// for vpage.ops.quant_matmul / dequantize_rows, which check the tensors first. The kernels
// still check types and sizes and throw ValueError.
#include <cstdint>

#include "bindings.h"
#include "vpage/kernels/quant_matmul.h"

namespace py = pybind11;

namespace vpage::bindings {

void bind_quant(py::module_& m) {
  m.def(
      "_cpu_quant_matmul",
      [](uintptr_t out, uintptr_t x, uintptr_t weight, int64_t rows, int32_t n, int32_t k, int64_t x_stride,
         int64_t out_stride, int32_t qtype, int32_t dtype, int num_threads) {
        QuantMatmulArgs args;
        args.out = reinterpret_cast<void*>(out);
        args.x = reinterpret_cast<const void*>(x);
        args.weight = reinterpret_cast<const uint8_t*>(weight);
        args.m = rows;
        args.n = n;
        args.k = k;
        args.x_stride = x_stride;
        args.out_stride = out_stride;
        args.type = static_cast<QuantType>(qtype);
        args.dtype = static_cast<DType>(dtype);
        py::gil_scoped_release release;
        cpu::quant_matmul(args, num_threads);
      },
      py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("x_stride"),
      py::arg("out_stride"), py::arg("qtype"), py::arg("dtype"), py::arg("num_threads"),
      "out [m, n] = x [m, k] @ W^T, W = n rows of k values in ggml block format qtype (uint8,\n"
      "contiguous). x/out dtype codes: 0 float32, 1 float16, 2 bfloat16; strides in elements.");
  m.def(
      "_cpu_quant_dequantize_rows",
      [](uintptr_t out, uintptr_t weight, int64_t rows, int32_t k, int32_t qtype) {
        py::gil_scoped_release release;
        cpu::quant_dequantize_rows(static_cast<QuantType>(qtype), reinterpret_cast<const uint8_t*>(weight), rows, k,
                                   reinterpret_cast<float*>(out));
      },
      py::arg("out"), py::arg("weight"), py::arg("rows"), py::arg("k"), py::arg("qtype"),
      "Dequantizes rows contiguous ggml-format rows of k values into float32 out [rows, k].");
  m.def(
      "_cpu_quant_repack_x4",
      [](uintptr_t out, uintptr_t weight, int64_t rows, int32_t k, int32_t qtype) {
        py::gil_scoped_release release;
        return cpu::quant_repack_x4(static_cast<QuantType>(qtype), reinterpret_cast<const uint8_t*>(weight), rows, k,
                                    reinterpret_cast<uint8_t*>(out));
      },
      py::arg("out"), py::arg("weight"), py::arg("rows"), py::arg("k"), py::arg("qtype"),
      "Writes rows Q4_1 or Q8_0 rows of k values (rows a multiple of 4, k of 64) into out in the\n"
      "x4 layout of the CPU decode kernel (Q4_1x4 = 259, Q8_0x4 = 264) and returns True; False,\n"
      "out untouched, for Q8_0 rows holding a quant of -128. out must not overlap weight.");
  m.def(
      "_cpu_quant_repack_x8",
      [](uintptr_t out, uintptr_t weight, int64_t rows, int32_t k, int32_t qtype) {
        py::gil_scoped_release release;
        cpu::quant_repack_x8(static_cast<QuantType>(qtype), reinterpret_cast<const uint8_t*>(weight), rows, k,
                             reinterpret_cast<uint8_t*>(out));
      },
      py::arg("out"), py::arg("weight"), py::arg("rows"), py::arg("k"), py::arg("qtype"),
      "Writes rows Q4_1 or Q8_0 rows of k values (rows a multiple of 8) into out in the x8 layout\n"
      "of the VNNI decode kernel (Q4_1x8 = 515, Q8_0x8 = 520). out must not overlap weight.");
  m.def("quant_reads_x8", &cpu::quant_reads_x8,
        "Whether the selected instruction set's decode kernel reads x8 rows (VNNI builds); elsewhere\n"
        "they are unpacked task by task, with the same results.");
  m.attr("QUANT_INTEGER_PATH_ROWS") = cpu::kQuantIntegerPathRows;
  m.attr("QUANT_INTEGER_GEMM_MAX_ROWS") = cpu::kQuantIntegerGemmMaxRows;
  m.def("set_quant_integer_gemm_rows", &cpu::set_quant_integer_gemm_rows, py::arg("max_rows"),
        "Most rows the integer GEMM path (Q4_0/Q4_1/Q8_0 beyond QUANT_INTEGER_PATH_ROWS rows) takes\n"
        "(default QUANT_INTEGER_GEMM_MAX_ROWS; 0: none, the float path): for benchmarks and tests.");
  m.def("quant_matmul_isa", &cpu::quant_matmul_isa,
        "Instruction set level of the quantized matmul (follows set_cpu_isa, same names).");
}

}  // namespace vpage::bindings
