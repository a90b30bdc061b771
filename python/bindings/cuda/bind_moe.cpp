// vpage._cuda: fused_moe (the mixture-of-experts block, grouped by expert).
#include <tuple>

#include <pybind11/stl.h>

#include "cuda_bindings.h"
#include "vpage/cuda/fused_moe.h"

namespace py = pybind11;

namespace vpage::cuda_bindings {
namespace {

// (device pointer, bytes between experts) of a plain expert stack of the activations' dtype.
using ExpertStack = std::tuple<std::uintptr_t, int64_t>;

MoeExpertWeights expert_weights(const ExpertStack& stack, DType dtype) {
  MoeExpertWeights w;
  w.data = as_ptr<const void*>(std::get<0>(stack));
  w.expert_bytes = std::get<1>(stack);
  w.dtype = dtype;
  return w;
}

void fused_moe(std::uintptr_t out, std::uintptr_t x, std::uintptr_t router_logits, std::uintptr_t topk_ids,
               std::uintptr_t topk_weights, int64_t m, int32_t hidden, int32_t intermediate, int32_t num_experts,
               int32_t top_k, bool renormalize, int64_t x_stride, int64_t out_stride, int dtype,
               const ExpertStack& w1, const ExpertStack& w3, const ExpertStack& w2, std::uintptr_t workspace,
               std::size_t workspace_bytes, std::uintptr_t stream) {
  FusedMoeArgs a;
  a.out = as_ptr<void*>(out);
  a.x = as_ptr<const void*>(x);
  a.router_logits = as_ptr<const float*>(router_logits);
  a.topk_ids = as_ptr<const int32_t*>(topk_ids);
  a.topk_weights = as_ptr<const float*>(topk_weights);
  a.m = m;
  a.hidden = hidden;
  a.intermediate = intermediate;
  a.num_experts = num_experts;
  a.top_k = top_k;
  a.renormalize = renormalize;
  a.x_stride = x_stride;
  a.out_stride = out_stride;
  a.dtype = to_dtype(dtype);
  a.w1 = expert_weights(w1, a.dtype);
  a.w3 = expert_weights(w3, a.dtype);
  a.w2 = expert_weights(w2, a.dtype);
  py::gil_scoped_release release;
  check(cuda::fused_moe(a, as_ptr<void*>(workspace), workspace_bytes, as_ptr<cudaStream_t>(stream)), "fused_moe");
}

}  // namespace

void bind_moe(py::module_& m) {
  m.def("fused_moe_workspace_bytes", &cuda::fused_moe_workspace_bytes, py::arg("m"), py::arg("top_k"),
        py::arg("num_experts"), py::arg("hidden"), py::arg("intermediate"),
        "Bytes of device workspace fused_moe needs for these sizes.");
  m.def("fused_moe", &fused_moe, py::arg("out"), py::arg("x"), py::arg("router_logits"), py::arg("topk_ids"),
        py::arg("topk_weights"), py::arg("m"), py::arg("hidden"), py::arg("intermediate"), py::arg("num_experts"),
        py::arg("top_k"), py::arg("renormalize"), py::arg("x_stride"), py::arg("out_stride"), py::arg("dtype"),
        py::arg("w1"), py::arg("w3"), py::arg("w2"), py::arg("workspace"), py::arg("workspace_bytes"),
        py::arg("stream"),
        "out [m, hidden] = the mixture-of-experts block on x (vpage/cuda/fused_moe.h); expert stacks\n"
        "(pointer, bytes between experts) of plain [n, k] matrices of x's dtype; router_logits float32\n"
        "[m, experts] or 0 with topk_ids int32 / topk_weights float32 [m, top_k].");
}

}  // namespace vpage::cuda_bindings
