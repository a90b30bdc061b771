// The mixture-of-experts block of a decoder layer on the CPU, fused into one call: routing
// (softmax over the router logits, top-k, optional renormalisation), tokens grouped by expert,
// each expert's gate/up matmul, SiLU-and-multiply and down matmul on only its own tokens, and
// the routing-weighted sum back into each token's row. Expert weights stay as they were
// loaded: packed float panels (dense_matmul.h) or raw GGUF blocks (quant_matmul.h), never
// copied or dequantized whole.
#pragma once

#include <cstdint>

#include "vpage/kernels/kernel_args.h"
#include "vpage/kernels/quant_matmul.h"

namespace vpage {

/// One stack of num_experts matrices of the same shape [n, k], expert e's at
/// `data + e * expert_bytes`: either packed float panels (dense_pack's [ceil(n / 32), k, 32]
/// of `dtype`) or, when `quantized`, n rows of raw GGUF blocks of `qtype`.
struct MoeExpertWeights {
  const void* data = nullptr;
  int64_t expert_bytes = 0;       // bytes from one expert's matrix to the next
  bool quantized = false;
  QuantType qtype = QuantType::kQ8_0;  // when quantized (k a multiple of its block values)
  DType dtype = DType::kFloat32;       // of the packed panels when not quantized
};

/// out[t] = sum over the top_k experts e chosen for token t of weight(t, e) * w2_e(silu(
/// w1_e(x[t])) * w3_e(x[t])): w1 (gate) and w3 (up) experts [intermediate, hidden], w2 (down)
/// experts [hidden, intermediate]. A checkpoint's fused gate/up rows of GGUF blocks serve as w1
/// and w3 with the same expert_bytes, w3's data `intermediate` rows further on.
/// Routing: with router_logits, p = softmax(logits[t]) in float32, the top_k largest p (ties:
/// the lower expert id), weight = p, divided by their sum when `renormalize` (Mixtral; Qwen3-MoE
/// with norm_topk_prob); without, the given topk_ids / topk_weights.
struct FusedMoeArgs {
  void* out = nullptr;                   // [m, hidden], row stride out_stride, dtype `dtype`; may be x
  const void* x = nullptr;               // [m, hidden], row stride x_stride, dtype `dtype`
  const float* router_logits = nullptr;  // [m, num_experts] float32 contiguous, or nullptr
  const int32_t* topk_ids = nullptr;     // [m, top_k] in [0, num_experts) (when no logits)
  const float* topk_weights = nullptr;   // [m, top_k] float32 (when no logits)
  int64_t m = 0;                         // tokens
  int32_t hidden = 0;
  int32_t intermediate = 0;              // per expert (this rank's share under tensor parallelism)
  int32_t num_experts = 0;
  int32_t top_k = 0;                     // 1 <= top_k <= num_experts
  bool renormalize = false;
  int64_t x_stride = 0;                  // elements between rows of x (>= hidden)
  int64_t out_stride = 0;                // elements between rows of out (>= hidden)
  DType dtype = DType::kFloat32;         // of x and out
  MoeExpertWeights w1;                   // gate: [num_experts][intermediate, hidden]
  MoeExpertWeights w3;                   // up: [num_experts][intermediate, hidden]
  MoeExpertWeights w2;                   // down: [num_experts][hidden, intermediate]
};

namespace cpu {

/// Runs the block. x rows are gathered by expert (float32; each expert's rows start on a
/// multiple of 4) and, for Q4_0/Q4_1/Q8_0 weights, quantized once per matmul for the integer
/// paths. Threads: the gate and up matmuls are one parallel_for (two when their block types
/// differ), the down matmul another, over the (expert, block of weight rows [and of token
/// rows]) tasks of every expert that has tokens, cut as quant_matmul or dense_matmul cut one
/// expert's matmul (experts with the most tokens first); routing, the SiLU and the weighted sum
/// go over token ranges. Each output sums its experts in top-k order, so a row's result does
/// not depend on the thread count. Float32 intermediates; tokens go at most
/// kFusedMoeTokensPerPass per pass, and every row is read before any is written (out may be x).
/// Throws vpage::CheckError on bad sizes, types, expert ids or null pointers.
void fused_moe(const FusedMoeArgs& args, int num_threads);

/// Tokens routed per pass of fused_moe (bounds its float32 buffers: about top_k x this many rows
/// of 2 x hidden + 3 x intermediate values).
constexpr int64_t kFusedMoeTokensPerPass = 1024;

}  // namespace cpu
}  // namespace vpage
