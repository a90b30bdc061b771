// CPU kernels of vpage_core: the engine's CPU backend, twins of the CUDA kernels with the
// same cache layout (see kernel_args.h). Vectorised per CPU (the widest instruction set
// the processor supports is chosen once at run time) and multi-threaded, on vpage's own
// persistent thread pool or on the process's OpenMP threads (set_thread_source). Broken
// preconditions throw vpage::CheckError.
#pragma once

#include <string>

#include "vpage/common.h"
#include "vpage/kernels/kernel_args.h"

namespace vpage::cpu {

/// Writes the key/value rows of new tokens into their cache slots (bit-exact copies;
/// key/value have the cache's dtype). Tokens with slot < 0 are skipped.
/// Threads: tokens are split into contiguous ranges, one per thread.
void reshape_and_cache(const ReshapeAndCacheArgs& args, int num_threads);

/// Paged attention, decode (args.query_start_loc == nullptr, one query per sequence) or
/// prefill/chunked prefill (causal; the queries are the last tokens of each context).
/// Requires head_size % 16 == 0 and num_heads % num_kv_heads == 0; fp32 accumulation.
/// Threads: one task per (sequence, kv head[, query tile][, context partition]); each
/// task reads a K/V block once for all query heads of its GQA group. Decode splits long
/// contexts into partitions when there are too few tasks for the threads, then reduces.
void paged_attention(const PagedAttentionArgs& args, int num_threads);

/// Bidirectional attention over packed sequences (see PackedAttentionArgs); fp32 accumulation.
/// Threads: one task per (sequence, head, tile of queries); a query's result does not depend
/// on the other sequences of the call or on the thread count.
void packed_attention(const PackedAttentionArgs& args, int num_threads);

/// Copies whole blocks src -> dst in every layer's key and value cache (bit-exact).
/// Threads: one task per (layer, pair).
void copy_blocks(const CopyBlocksArgs& args, int num_threads);

/// Copies whole blocks between two cache tensors of one per-block layout (bit-exact).
/// Threads: one task per pair.
void swap_blocks(const SwapBlocksArgs& args, int num_threads);

/// Instruction set level of the CPU kernels (paged_attention, quant_matmul): "avx512vnni",
/// "avx512", "avx2vnni" (AVX-VNNI without AVX-512), "avx2" or "generic". A VNNI level runs its
/// base level's attention build and a quantized matmul whose integer paths use vpdpbusd (the
/// same exact integer sums, so the same outputs as the base level). The environment variable
/// VPAGE_CPU_ISA, read at the kernels' first use, caps it like set_cpu_isa (a bad value throws
/// from that first use).
std::string cpu_isa();

/// Restricts the CPU kernels to `isa` (one of cpu_isa's names, or "auto" = best).
/// Throws vpage::CheckError when the name is unknown or the CPU lacks the set.
/// Meant for tests and benchmarks; not thread-safe against running kernels.
void set_cpu_isa(const std::string& isa);

/// Where the kernels' threads come from: "own" (vpage's pool, the default) or "openmp" (the
/// GNU OpenMP runtime another library, such as torch, already loaded into the process, so
/// that its ops and vpage's kernels share one set of threads instead of contending for the
/// cores). Returns the OpenMP runtime's file name in use, "" for the own pool ("openmp"
/// falls back to it when no runtime is loaded). A fork()ed child goes back to the own pool.
/// Throws vpage::CheckError for another name. Not thread-safe against running kernels.
std::string set_thread_source(const std::string& source);

}  // namespace vpage::cpu
