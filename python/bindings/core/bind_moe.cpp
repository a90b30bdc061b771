// vpage._core mixture-of-experts kernel: a private raw-pointer entry point (underscore name)
// for vpage.ops.fused_moe, which checks the tensors first. The kernel still checks sizes,
// types and expert ids and throws ValueError.
#include <cstdint>
#include <tuple>

#include <pybind11/stl.h>

#include "bindings.h"
#include "vpage/kernels/fused_moe.h"

namespace py = pybind11;

namespace vpage::bindings {
namespace {

// (data pointer, bytes between experts, ggml type id or -1 for packed float, dtype code).
using ExpertStack = std::tuple<uintptr_t, int64_t, int32_t, int32_t>;

MoeExpertWeights expert_weights(const ExpertStack& stack) {
  MoeExpertWeights w;
  w.data = reinterpret_cast<const void*>(std::get<0>(stack));
  w.expert_bytes = std::get<1>(stack);
  w.quantized = std::get<2>(stack) >= 0;
  if (w.quantized) w.qtype = static_cast<QuantType>(std::get<2>(stack));
  w.dtype = static_cast<DType>(std::get<3>(stack));
  return w;
}

}  // namespace

void bind_moe(py::module_& m) {
  m.def(
      "_cpu_fused_moe",
      [](uintptr_t out, uintptr_t x, uintptr_t router_logits, uintptr_t topk_ids, uintptr_t topk_weights, int64_t rows,
         int32_t hidden, int32_t intermediate, int32_t num_experts, int32_t top_k, bool renormalize, int64_t x_stride,
         int64_t out_stride, int32_t dtype, const ExpertStack& w1, const ExpertStack& w3, const ExpertStack& w2,
         int num_threads) {
        FusedMoeArgs args;
        args.out = reinterpret_cast<void*>(out);
        args.x = reinterpret_cast<const void*>(x);
        args.router_logits = reinterpret_cast<const float*>(router_logits);
        args.topk_ids = reinterpret_cast<const int32_t*>(topk_ids);
        args.topk_weights = reinterpret_cast<const float*>(topk_weights);
        args.m = rows;
        args.hidden = hidden;
        args.intermediate = intermediate;
        args.num_experts = num_experts;
        args.top_k = top_k;
        args.renormalize = renormalize;
        args.x_stride = x_stride;
        args.out_stride = out_stride;
        args.dtype = static_cast<DType>(dtype);
        args.w1 = expert_weights(w1);
        args.w3 = expert_weights(w3);
        args.w2 = expert_weights(w2);
        py::gil_scoped_release release;
        cpu::fused_moe(args, num_threads);
      },
      py::arg("out"), py::arg("x"), py::arg("router_logits"), py::arg("topk_ids"), py::arg("topk_weights"),
      py::arg("m"), py::arg("hidden"), py::arg("intermediate"), py::arg("num_experts"), py::arg("top_k"),
      py::arg("renormalize"), py::arg("x_stride"), py::arg("out_stride"), py::arg("dtype"), py::arg("w1"),
      py::arg("w3"), py::arg("w2"), py::arg("num_threads"),
      "out [m, hidden] = the mixture-of-experts block on x (fused_moe.h). router_logits float32 [m, experts]\n"
      "or 0 with topk_ids int32 / topk_weights float32 [m, top_k]; w1/w3/w2: (pointer, bytes between experts,\n"
      "ggml type id or -1 for packed float panels, dtype code of those panels).");
}

}  // namespace vpage::bindings
