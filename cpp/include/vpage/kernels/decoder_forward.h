// One forward of a decoder on the CPU, with float32, bfloat16 or float16 activations and
// every projection kept in a GGUF block format or packed float weights (dense_matmul.h): the
// layers' kernels run back to back from C++, with nothing between them. Two layer structures: Llama's (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3)
// and Gemma's (Gemma 2 and 3: a norm before and after each block); per layer a sliding
// window, an attention logit soft-cap, per-head q/k norms and a rotary table of its own; the
// MLP part a gated MLP or a mixture of experts (router + fused_moe: Mixtral, Qwen3-MoE); per
// token a LoRA adapter slot on the attention's and the gated MLP's projections (lora.h). They
// are the kernels the Python model code calls one by one (RMSNorm, quant_matmul, per-head
// RMSNorm, rotary, reshape_and_cache, paged attention, SiLU- or GELU-and-multiply), called in
// the same order on the same arguments, so the hidden states are bitwise those of the
// layer-by-layer path; what goes away is the interpreter's time between kernels, which
// dominates a small decode step.
#pragma once

#include <cstdint>

#include "vpage/common.h"
#include "vpage/kernels/dense_matmul.h"
#include "vpage/kernels/fused_moe.h"
#include "vpage/kernels/kernel_args.h"
#include "vpage/kernels/lora.h"
#include "vpage/kernels/quant_matmul.h"

namespace vpage {

/// How a projection's weight is stored.
enum class WeightFormat : int32_t {
  kQuantized = 0,    // rows of raw GGUF blocks of LinearWeights::type (QuantMatmulArgs)
  kPackedDense = 1,  // dense_pack's panels of LinearWeights::dense_dtype (DenseMatmulArgs)
};

/// y = x @ W^T (+ bias).
struct LinearWeights {
  const void* weight = nullptr;
  WeightFormat format = WeightFormat::kQuantized;
  QuantType type = QuantType::kQ4_0;      // kQuantized
  DType dense_dtype = DType::kFloat32;    // kPackedDense
  const float* bias = nullptr;            // [out_features] float32, or nullptr
};

/// How a layer's blocks are normed and joined to the residual stream.
enum class DecoderStructure : int32_t {
  /// h = attn(norm(x)); x += h; out = mlp(norm(x)) (LlamaDecoderLayer).
  kLlama = 0,
  /// h = post_attention_norm(attn(input_norm(x))); x += h;
  /// out = post_feedforward_norm(mlp(pre_feedforward_norm(x))) (GemmaDecoderLayer).
  kGemma = 1,
};

/// The gated MLP's activation: silu(gate) * up or gelu_tanh(gate) * up.
enum class MlpActivation : int32_t { kSilu = 0, kGeluTanh = 1 };

/// What every layer's MLP part is.
enum class MlpKind : int32_t {
  kGated = 0,      // gate_up, the activation, down (LlamaMLP, GemmaMLP)
  kSparseMoe = 1,  // a router, fused_moe's experts, optionally a shared expert (SparseMoeBlock)
};

/// A layer's mixture-of-experts block (MlpKind::kSparseMoe): router logits = x @ router^T in
/// the activations' dtype, as float32, then fused_moe (SiLU experts) over the three stacks;
/// with DecoderShape::shared_intermediate_size, plus sigmoid(shared_gate(x)) times the shared
/// expert's gated SiLU MLP (sigmoid_gated_add).
struct DecoderMoeWeights {
  LinearWeights router;  // [num_experts, hidden_size]
  MoeExpertWeights w1;   // gate: [num_experts][intermediate_size, hidden_size]
  MoeExpertWeights w3;   // up: [num_experts][intermediate_size, hidden_size]
  MoeExpertWeights w2;   // down: [num_experts][hidden_size, intermediate_size]
  LinearWeights shared_gate_up;  // [2 shared_intermediate_size, hidden_size], or unused
  LinearWeights shared_down;     // [hidden_size, shared_intermediate_size], or unused
  LinearWeights shared_gate;     // [1, hidden_size], or unused
};

/// One decoder layer: its weights, its attention's settings and rotary table, and its KV
/// cache (geometry in DecoderShape::cache).
struct DecoderLayerWeights {
  // The norms' weights have the activations' dtype (DecoderShape::dtype).
  const void* input_norm = nullptr;              // [hidden_size]
  LinearWeights qkv;                        // [(num_heads + 2 num_kv_heads) head_size, hidden_size]
  const void* q_norm = nullptr;                  // [head_size]: per-head RMSNorm of the queries, or nullptr
  const void* k_norm = nullptr;                  // [head_size]: per-head RMSNorm of the keys, or nullptr
  LinearWeights o;                          // [hidden_size, num_heads head_size]
  const void* post_attention_norm = nullptr;     // [hidden_size]
  const void* pre_feedforward_norm = nullptr;    // [hidden_size]: kGemma only (nullptr for kLlama)
  LinearWeights gate_up;                    // [2 intermediate_size, hidden_size]: gate rows, then up (kGated)
  LinearWeights down;                       // [hidden_size, intermediate_size] (kGated)
  DecoderMoeWeights moe;                    // kSparseMoe
  const void* post_feedforward_norm = nullptr;   // [hidden_size]: kGemma only (nullptr for kLlama)
  const float* cos_sin = nullptr;  // [max_position, rotary_dim]: cos half, then sin half (RotaryArgs)
  int64_t max_position = 0;
  int32_t rotary_dim = 0;          // leading dimensions of each head that rotate; 0 = head_size
  float attention_scale = 1.0f;
  int32_t sliding_window = 0;      // PagedAttentionArgs::sliding_window (0 = none)
  float logits_soft_cap = 0.0f;    // PagedAttentionArgs::logits_soft_cap (0 = none)
  void* key_cache = nullptr;
  void* value_cache = nullptr;
  // LoRA adapters of the gated MLP layers' projections (lora.h), each a table
  // [DecoderShape::num_lora_slots] or nullptr (no LoRA on that projection); added to the
  // projection's output right after it (qkv's before the q/k norms and the rotary).
  const LoraAdapterWeights* lora_qkv = nullptr;      // slices: q, k, v rows
  const LoraAdapterWeights* lora_o = nullptr;
  const LoraAdapterWeights* lora_gate_up = nullptr;  // slices: gate, up rows
  const LoraAdapterWeights* lora_down = nullptr;
};

/// Sizes and settings shared by every layer.
struct DecoderShape {
  DecoderStructure structure = DecoderStructure::kLlama;
  MlpActivation activation = MlpActivation::kSilu;
  int32_t hidden_size = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_size = 0;
  int32_t intermediate_size = 0;      // the MLP's, or each expert's (kSparseMoe)
  MlpKind mlp = MlpKind::kGated;
  int32_t num_experts = 0;            // kSparseMoe: FusedMoeArgs's routing
  int32_t top_k = 0;
  bool renormalize = false;
  int32_t shared_intermediate_size = 0;  // kSparseMoe: the shared expert's (0: none)
  float rms_norm_eps = 1e-6f;         // of every [hidden_size] norm
  float head_norm_eps = 1e-6f;        // of the q/k norms
  const void* final_norm = nullptr;   // [hidden_size], dtype `dtype`
  DType dtype = DType::kFloat32;      // activations (and the norms' weights)
  CacheShape cache;                   // every layer's KV cache: `dtype`, or 16-bit under float32 activations
  int32_t num_lora_slots = 0;         // entries of every layer's LoRA tables
  DType lora_dtype = DType::kFloat32; // of the adapters' packed A and B
};

/// The step's flattened batch (see ForwardBatch in Python) and where its result goes.
struct DecoderBatch {
  const void* embeddings = nullptr;        // [num_tokens, hidden_size], the token embeddings (scaled, for Gemma)
  void* out = nullptr;                     // [num_tokens, hidden_size]: final-normed hidden states
  const int64_t* positions = nullptr;      // [num_tokens]
  const int64_t* slot_mapping = nullptr;   // [num_tokens]
  const int32_t* block_tables = nullptr;   // [num_seqs, max_blocks_per_seq]
  const int32_t* context_lens = nullptr;   // [num_seqs]
  const int32_t* query_start_loc = nullptr;  // [num_seqs + 1]; nullptr = decode (one token per sequence)
  int64_t num_tokens = 0;
  int32_t num_seqs = 0;
  int32_t max_blocks_per_seq = 0;
  int32_t max_context_len = 0;
  bool draft_queries = false;  // rows of several tokens are a decode token and its drafts (PagedAttentionArgs)
  const int32_t* lora_token_slots = nullptr;  // [num_tokens]: each token's LoRA slot (-1: none); nullptr: no adapter
};

namespace cpu {

/// Runs every layer and the final norm over `batch`, writing the step's K/V into each
/// layer's cache. Activations live in a per-thread workspace reused across calls.
/// Throws vpage::CheckError on inconsistent sizes or on a bad index a kernel meets
/// (position, slot, block id); `out` and the step's cache slots are then unspecified, as
/// after a failing layer-by-layer forward.
void decoder_forward(const DecoderShape& shape, const DecoderLayerWeights* layers, int32_t num_layers,
                     const DecoderBatch& batch, int num_threads);

}  // namespace cpu
}  // namespace vpage
