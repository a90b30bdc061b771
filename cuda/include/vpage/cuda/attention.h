// Paged attention on the GPU: decode (v1 one pass, v2 split context + reduce) and
// prefill (several query tokens per sequence, causal). Layout: see vpage/kernels/kernel_args.h.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

#include "vpage/kernels/kernel_args.h"

namespace vpage::cuda {

/// Tokens per partition of the split (v2) kernels, at most; a multiple of every block size.
/// Small grids halve it (down to 128 tokens) until there are 4 thread blocks per SM.
inline constexpr int kAttentionPartitionSize = 512;

/// Which attention kernel runs. Decode: kAuto applies choose_attention_version, kV1/kV2
/// force one, kTiled is invalid. Prefill: kAuto runs the tiled kernel (one thread block per
/// query tile x KV head group) when the GPU can (sm_80+ for 16-bit types, enough shared
/// memory), else the per-row v1/v2 kernels chosen as for decode; kTiled forces the tiled
/// kernel (cudaErrorInvalidValue when it cannot run); kV1/kV2 force the per-row kernels
/// (one thread block per query token and head), kept as an independent cross-check.
enum class AttentionVersion : int { kAuto = 0, kV1 = 1, kV2 = 2, kTiled = 3 };

/// The heuristic behind kAuto. Decode thread blocks serve all query heads of a KV head's
/// GQA group (up to 8; larger groups take several blocks), so a row has
/// num_kv_heads * ceil(group / heads_per_block) of them. v1 (one thread block per row and
/// head group, whole context) is chosen when the context fits one partition
/// (<= kAttentionPartitionSize tokens), or when there are 2 to 4 thread blocks per SM and the
/// context is at most 8192 tokens. Otherwise v2: the context is split into partitions,
/// giving more parallelism to small batches and bounding the work and shared memory per
/// thread block for long contexts. v1 is also never chosen when its logits (4 bytes per token
/// and query head of a thread block) do not fit the shared memory of `max_smem_bytes`.
AttentionVersion choose_attention_version(int64_t num_rows, int32_t num_heads, int32_t num_kv_heads,
                                          int32_t max_context_len, int num_sms, size_t max_smem_bytes);

/// Bytes of device scratch that paged_attention_decode / paged_prefill_attention need for
/// `args` and `version` (0 when v1 or the tiled prefill runs). Queries the current device
/// (SM count, shared memory, compute capability) for kAuto.
size_t paged_attention_workspace_bytes(const PagedAttentionArgs& args,
                                       AttentionVersion version = AttentionVersion::kAuto);

/// Decode attention: one query token per sequence (args.query_start_loc == nullptr).
/// `workspace` is device memory of at least paged_attention_workspace_bytes(args, version)
/// bytes (may be null when that is 0), used by v2 only, aligned to 16 bytes.
/// Supports head sizes 64, 80, 96, 128, 256 and block sizes 8, 16, 32; returns
/// cudaErrorInvalidValue for other shapes or a forced v1 whose context does not fit.
cudaError_t paged_attention_decode(const PagedAttentionArgs& args, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream,
                                   AttentionVersion version = AttentionVersion::kAuto);

/// Prefill / chunked-prefill attention (args.query_start_loc != nullptr): query row j of a
/// sequence with q query tokens and context L attends causally to positions [0, L - q + j]
/// (with args.sliding_window W only the last W of them; blocks before every query's window
/// are never read).
/// Same workspace and shape rules as paged_attention_decode; see AttentionVersion for the
/// kernel choice. Launches on `stream`, which must belong to the current device.
cudaError_t paged_prefill_attention(const PagedAttentionArgs& args, void* workspace,
                                    size_t workspace_bytes, cudaStream_t stream,
                                    AttentionVersion version = AttentionVersion::kAuto);

}  // namespace vpage::cuda
