// Batched multi-LoRA on the GPU (Punica's BGMV): the CUDA twin of vpage::cpu::lora_add
// (vpage/kernels/lora.h). Every row names an adapter slot (or none) and gets its adapter's
// low-rank update added to the projection's output: a shrink into float32 and an expand.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "vpage/kernels/lora.h"

namespace vpage::cuda {

/// Bytes of device workspace lora_add needs: the float32 shrink results [m, num_slices * max_rank].
size_t lora_add_workspace_bytes(int64_t m, int32_t num_slices, int32_t max_rank);

/// lora.h's update with the same arguments, except that every pointer is a device pointer on the
/// current device: args.slots is a device table [num_slots] whose A and B are plain row-major
/// matrices (not packed) of args.weight_dtype, A [num_slices * rank, k] and B [slice_rows[j], rank],
/// each contiguous. max_rank bounds every rank of the table (a slot above it is skipped, never
/// read past the workspace), and `workspace` holds lora_add_workspace_bytes(m, num_slices,
/// max_rank). Rows whose slot is outside [0, num_slots), or whose slot has no A, are skipped
/// without a check (a host check would need a synchronisation); out is rounded once per value.
/// Two kernels on `stream`, no host synchronisation (capturable in a CUDA graph). Returns
/// cudaErrorInvalidValue on bad sizes or null pointers, else the first launch error.
cudaError_t lora_add(const LoraArgs& args, int32_t max_rank, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream);

}  // namespace vpage::cuda
