// vpage._cuda: apply_token_bitmask (structured outputs).
#include "cuda_bindings.h"
#include "vpage/cuda/token_bitmask.h"

namespace py = pybind11;

namespace vpage::cuda_bindings {
namespace {

void apply_token_bitmask(std::uintptr_t logits, int64_t num_rows, int64_t vocab, int64_t row_stride,
                         std::uintptr_t bitmask, int64_t bitmask_stride, std::uintptr_t stream) {
  TokenBitmaskArgs a;
  a.logits = as_ptr<float*>(logits);
  a.num_rows = num_rows;
  a.vocab = vocab;
  a.row_stride = row_stride;
  a.bitmask = as_ptr<const int32_t*>(bitmask);
  a.bitmask_stride = bitmask_stride;
  py::gil_scoped_release release;
  check(cuda::apply_token_bitmask(a, as_ptr<cudaStream_t>(stream)), "apply_token_bitmask");
}

}  // namespace

void bind_token_bitmask(py::module_& m) {
  m.def("apply_token_bitmask", &apply_token_bitmask, py::arg("logits"), py::arg("num_rows"), py::arg("vocab"),
        py::arg("row_stride"), py::arg("bitmask"), py::arg("bitmask_stride"), py::arg("stream"),
        "In place: -inf in float32 logits [num_rows, vocab] (rows row_stride apart) wherever the int32\n"
        "bitmask [num_rows, bitmask_stride] has a 0 bit (bit t % 32 of word t / 32: token t).");
}

}  // namespace vpage::cuda_bindings
