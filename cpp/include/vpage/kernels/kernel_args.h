// Argument structs shared by the CPU kernels (vpage_core) and the CUDA kernels (cuda/).
// Kernels take raw pointers, sizes and strides; the caller (vpage.ops) has already
// checked dtype, device, shape and contiguity. Strides are in elements.
#pragma once

#include <cstdint>

namespace vpage {

/// Element type of activations and KV caches.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

/// Whether activations of dtype `activation` may meet a KV cache of dtype `cache`: the same
/// dtype, or (CPU kernels only) float32 activations with a 16-bit cache, converted to the
/// cache's dtype when written (reshape_and_cache) and to float32 when read (attention).
inline bool kv_dtypes_supported(DType activation, DType cache) {
  return activation == cache || activation == DType::kFloat32;
}

/// Size of one element of `dtype` in bytes.
inline int dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

/// Elements per 16-byte key fragment: the innermost dimension `x` of the key cache.
inline int key_pack_size(DType dtype) { return 16 / dtype_size(dtype); }

/// KV cache geometry of one layer:
///   key_cache   [num_blocks, num_kv_heads, head_size / x, block_size, x]
///   value_cache [num_blocks, num_kv_heads, head_size, block_size]
///   slot = block_id * block_size + offset_in_block
struct CacheShape {
  int64_t num_blocks = 0;
  int32_t num_kv_heads = 0;
  int32_t head_size = 0;
  int32_t block_size = 0;
  DType dtype = DType::kFloat32;
};

/// reshape_and_cache: writes key/value rows of new tokens into their slots.
struct ReshapeAndCacheArgs {
  const void* key = nullptr;            // [num_tokens, num_kv_heads, head_size], row stride key_stride
  const void* value = nullptr;          // [num_tokens, num_kv_heads, head_size], row stride value_stride
  void* key_cache = nullptr;            // see CacheShape
  void* value_cache = nullptr;          // see CacheShape
  const int64_t* slot_mapping = nullptr;  // [num_tokens]; slot < 0 = skip (padding)
  int64_t num_tokens = 0;
  int64_t key_stride = 0;    // elements between consecutive tokens of `key`
  int64_t value_stride = 0;  // elements between consecutive tokens of `value`
  DType dtype = DType::kFloat32;  // of key and value (kv_dtypes_supported with cache.dtype)
  CacheShape cache;
};

/// Paged attention over cached K/V. Decode: one query token per sequence
/// (query_start_loc == nullptr, query row i belongs to sequence i). Prefill: the query
/// tokens of sequence s are rows [query_start_loc[s], query_start_loc[s+1]) and are the
/// *last* tokens of its context (causal: query j of a sequence of q tokens and context
/// length L sees positions [0, L - q + j]). Their K/V are already in the cache.
/// With a sliding window W, a query at position p sees only positions (p - W, p]; the blocks
/// that lie wholly before the window of a sequence's earliest query are never read, and their
/// block-table entries may hold anything (e.g. -1 once the block manager freed them).
/// Every query that takes the decode kernel (decode; prefill's one-query rows; with
/// draft_queries, every query) is scored over the same context partitions of its own length,
/// so its result is bitwise the same whatever else shares the step.
struct PagedAttentionArgs {
  void* out = nullptr;                      // [num_query_tokens, num_heads, head_size], contiguous
  const void* query = nullptr;              // [num_query_tokens, num_heads, head_size], row stride query_stride
  const void* key_cache = nullptr;          // see CacheShape
  const void* value_cache = nullptr;        // see CacheShape
  const int32_t* block_tables = nullptr;    // [num_seqs, max_blocks_per_seq]
  const int32_t* context_lens = nullptr;    // [num_seqs], tokens in cache incl. the queries
  const int32_t* query_start_loc = nullptr; // [num_seqs + 1] for prefill, nullptr for decode
  int32_t num_seqs = 0;
  int64_t num_query_tokens = 0;             // == num_seqs for decode
  int32_t num_heads = 0;                    // query heads; a multiple of cache.num_kv_heads
  int32_t max_blocks_per_seq = 0;
  int32_t max_context_len = 0;              // upper bound of context_lens (used for partitioning)
  int64_t query_stride = 0;                 // elements between consecutive query tokens
  float scale = 1.0f;                       // softmax scale, usually 1/sqrt(head_size)
  DType dtype = DType::kFloat32;            // of query and out (kv_dtypes_supported with cache.dtype)
  CacheShape cache;
  /// > 0: a query at position p attends keys at positions j with p - sliding_window < j <= p
  /// (sliding_window keys including itself); 0: no window.
  int32_t sliding_window = 0;
  /// > 0: each score s = scale * (q . k) becomes logits_soft_cap * tanh(s / logits_soft_cap)
  /// before the softmax (attention logit soft-capping); 0: none.
  float logits_soft_cap = 0.0f;
  /// Prefill only: each sequence's query rows are a decode token and its draft tokens
  /// (speculative decoding); the decode kernel scores each as a decode step at its position
  /// would, bitwise (without a window, one task reads the K/V once for all of them).
  bool draft_queries = false;
};

/// Bidirectional attention over packed sequences (encoders: no cache, no padding). Sequence s
/// has kv_lens[s] tokens, its keys and values at rows [kv_starts[s], kv_starts[s] + kv_lens[s])
/// of key/value; its queries are q_lens[s] rows from q_starts[s] of query (and of out), the
/// first at position q_offsets[s] of the sequence (all of its tokens, or only the rows a pooler
/// reads). Every query sees every key of its sequence, or with a window W > 0 those at
/// most W positions before or after it (|query position - key position| <= W). Query, key,
/// value and out share one dtype and num_heads (no GQA); rows may be strided, each row's heads
/// contiguous ([num_heads, head_size]).
struct PackedAttentionArgs {
  void* out = nullptr;            // row stride out_stride
  const void* query = nullptr;    // row stride query_stride
  const void* key = nullptr;      // row stride key_stride
  const void* value = nullptr;    // row stride value_stride
  const int32_t* kv_starts = nullptr;  // [num_seqs]
  const int32_t* kv_lens = nullptr;    // [num_seqs]
  const int32_t* q_starts = nullptr;   // [num_seqs]
  const int32_t* q_lens = nullptr;     // [num_seqs]
  const int32_t* q_offsets = nullptr;  // [num_seqs]; q_offsets[s] + q_lens[s] <= kv_lens[s]
  int32_t num_seqs = 0;
  int64_t num_query_rows = 0;   // rows of query and out (q_starts/q_lens index them)
  int64_t num_kv_rows = 0;      // rows of key and value
  int32_t num_heads = 0;
  int32_t head_size = 0;        // a multiple of 16
  int64_t query_stride = 0, key_stride = 0, value_stride = 0, out_stride = 0;  // elements
  float scale = 1.0f;           // softmax scale
  int32_t window = 0;           // 0: none
  DType dtype = DType::kFloat32;
};

/// First logical block paged attention reads for a sequence whose earliest query is at
/// position `first_query_pos`: the block holding that query's first windowed key (0 without
/// a window). Blocks before it lie wholly outside every query's window.
inline int32_t window_first_block(int32_t sliding_window, int32_t block_size, int32_t first_query_pos) {
  if (sliding_window <= 0) return 0;
  const int32_t first_key = first_query_pos - sliding_window + 1;
  return first_key > 0 ? first_key / block_size : 0;
}

/// copy_blocks: for every layer, copies whole blocks src -> dst in both caches.
struct CopyBlocksArgs {
  void* const* key_caches = nullptr;    // [num_layers] pointers to key caches of one shape
  void* const* value_caches = nullptr;  // [num_layers] pointers to value caches of one shape
  int32_t num_layers = 0;
  const int64_t* block_mapping = nullptr;  // [num_pairs, 2] (src, dst)
  int64_t num_pairs = 0;
  CacheShape cache;
};

/// swap_blocks: copies whole blocks between two pools of one layout (one cache tensor).
struct SwapBlocksArgs {
  const void* src = nullptr;  // [src_num_blocks, block_bytes / elem] cache tensor
  void* dst = nullptr;        // [dst_num_blocks, ...] same per-block layout
  int64_t block_bytes = 0;    // bytes of one block in this tensor
  const int64_t* block_mapping = nullptr;  // [num_pairs, 2] (src block, dst block)
  int64_t num_pairs = 0;
  int64_t src_num_blocks = 0;  // blocks in src: block ids are checked against it
  int64_t dst_num_blocks = 0;  // blocks in dst
};

}  // namespace vpage
