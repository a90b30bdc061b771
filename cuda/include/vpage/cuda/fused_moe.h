// The mixture-of-experts block on the GPU: the CUDA twin of vpage::cpu::fused_moe
// (vpage/kernels/fused_moe.h), grouped by expert.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "vpage/kernels/fused_moe.h"

namespace vpage::cuda {

/// Bytes of device workspace fused_moe needs for m tokens (routing, grouping, float32
/// intermediates of every (token, expert) pair).
size_t fused_moe_workspace_bytes(int64_t m, int32_t top_k, int32_t num_experts, int32_t hidden,
                                 int32_t intermediate);

/// fused_moe.h's block with the same arguments, except that every expert stack holds plain
/// row-major matrices ([n, k] of args.dtype, experts expert_bytes apart; `quantized` false and
/// `dtype` the activations'), all pointers on the current device, and `workspace` of at least
/// fused_moe_workspace_bytes. Routing, grouping (rows of an expert padded to the tile height),
/// the gate/up and down matmuls over (expert tile of rows, tile of columns) blocks and the
/// weighted sum in top-k order run as kernels on `stream`, without a host synchronisation.
/// Returns cudaErrorInvalidValue on bad arguments, else the first launch error.
cudaError_t fused_moe(const FusedMoeArgs& args, void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace vpage::cuda
