// decoder_forward: the Python model's layer loop (LlamaForCausalLM.forward, and
// Gemma2ForCausalLM.forward for DecoderStructure::kGemma) in C++. Each step below names the
// Python call it stands for; keep the two in the same order with the same arguments, since
// tests compare their outputs bit for bit.
#include "vpage/kernels/decoder_forward.h"

#include <cstring>
#include <initializer_list>
#include <vector>

#include "float_rows.h"
#include "vpage/common.h"
#include "vpage/kernels/cpu_kernels.h"
#include "vpage/kernels/layer_ops.h"
#include "vpage/kernels/rotary.h"

namespace vpage::cpu {
namespace {

// Activations of one step, grown as needed and kept for the next call of the same thread.
struct Workspace {
  std::vector<char> residual, hidden, qkv, attention, gate_up, activation, router, shared_gate_up, shared_activation,
      shared_out, shared_gate;
  std::vector<float> router_float32;

  static Workspace& of_this_thread() {
    thread_local Workspace workspace;
    return workspace;
  }
};

// Row-major [rows, cols] activations of the step's dtype, in a workspace buffer.
struct Rows {
  char* data;
  int64_t cols;
  int64_t element;  // bytes
  char* at(int64_t row, int64_t col = 0) const { return data + (row * cols + col) * element; }
};

Rows sized(std::vector<char>& buffer, int64_t rows, int64_t cols, DType dtype) {
  buffer.resize(static_cast<size_t>(rows * cols * dtype_size(dtype)));
  return {buffer.data(), cols, dtype_size(dtype)};
}

void check(const DecoderShape& s, const DecoderLayerWeights* layers, int32_t num_layers, const DecoderBatch& b) {
  const bool sizes_ok = s.hidden_size > 0 && s.num_heads > 0 && s.num_kv_heads > 0 && s.head_size > 0 &&
                        s.intermediate_size > 0 && s.num_heads % s.num_kv_heads == 0 &&
                        s.cache.num_kv_heads == s.num_kv_heads && s.cache.head_size == s.head_size &&
                        kv_dtypes_supported(s.dtype, s.cache.dtype) && num_layers > 0 && b.num_tokens >= 0 &&
                        b.num_seqs >= 0;
  VPAGE_CHECK(sizes_ok, "decoder_forward: inconsistent sizes (hidden "
                            << s.hidden_size << ", heads " << s.num_heads << "/" << s.num_kv_heads << ", head_size "
                            << s.head_size << ", layers " << num_layers
                            << "; the cache must have the model's KV heads)");
  const bool gemma = s.structure == DecoderStructure::kGemma;
  VPAGE_CHECK(gemma || s.structure == DecoderStructure::kLlama,
              "decoder_forward: unknown layer structure " << static_cast<int32_t>(s.structure));
  VPAGE_CHECK(s.activation == MlpActivation::kSilu || s.activation == MlpActivation::kGeluTanh,
              "decoder_forward: unknown MLP activation " << static_cast<int32_t>(s.activation));
  const bool moe = s.mlp == MlpKind::kSparseMoe;
  VPAGE_CHECK(s.mlp == MlpKind::kGated || (moe && s.activation == MlpActivation::kSilu && s.num_experts > 0 &&
                                           s.top_k >= 1 && s.top_k <= s.num_experts),
              "decoder_forward: bad MLP kind " << static_cast<int32_t>(s.mlp) << " (experts " << s.num_experts
                                               << ", top_k " << s.top_k << "; experts are SiLU)");
  VPAGE_CHECK(b.query_start_loc != nullptr || b.num_tokens == b.num_seqs,
              "decoder_forward: a decode batch has one token per sequence, got " << b.num_tokens << " tokens for "
                                                                                 << b.num_seqs);
  const bool pointers_ok = layers != nullptr && s.final_norm != nullptr &&
                           (b.num_tokens == 0 || (b.embeddings != nullptr && b.out != nullptr &&
                                                  b.positions != nullptr && b.slot_mapping != nullptr));
  VPAGE_CHECK(pointers_ok, "decoder_forward: null pointer");
  for (int32_t i = 0; i < num_layers; ++i) {
    const DecoderLayerWeights& l = layers[i];
    const bool shared_ok = s.shared_intermediate_size == 0 ||
                           (l.moe.shared_gate_up.weight && l.moe.shared_down.weight && l.moe.shared_gate.weight);
    const bool mlp_ok = moe ? l.moe.router.weight && l.moe.w1.data && l.moe.w3.data && l.moe.w2.data && shared_ok
                            : l.gate_up.weight && l.down.weight;
    VPAGE_CHECK(l.input_norm && l.post_attention_norm && l.qkv.weight && l.o.weight && mlp_ok && l.cos_sin &&
                    l.key_cache && l.value_cache,
                "decoder_forward: layer " << i << " has a null pointer");
    VPAGE_CHECK((l.pre_feedforward_norm != nullptr) == gemma && (l.post_feedforward_norm != nullptr) == gemma,
                "decoder_forward: layer " << i << (gemma ? " lacks" : " has")
                                          << " the Gemma structure's feed-forward norms");
    VPAGE_CHECK(!moe || (l.lora_gate_up == nullptr && l.lora_down == nullptr),
                "decoder_forward: layer " << i << " has LoRA on the MLP of a mixture of experts");
    VPAGE_CHECK(l.sliding_window >= 0 && l.logits_soft_cap >= 0.0f,
                "decoder_forward: layer " << i << " has a negative sliding window or soft-cap");
    std::vector<const LinearWeights*> linears = {&l.qkv, &l.o};
    if (!moe) {
      linears.insert(linears.end(), {&l.gate_up, &l.down});
    } else {
      linears.push_back(&l.moe.router);
      if (s.shared_intermediate_size > 0) {
        linears.insert(linears.end(), {&l.moe.shared_gate_up, &l.moe.shared_down, &l.moe.shared_gate});
      }
    }
    for (const LinearWeights* w : linears) {
      VPAGE_CHECK(w->format == WeightFormat::kPackedDense || s.dtype == DType::kFloat32,
                  "decoder_forward: layer " << i << " has quantized projections under 16-bit activations");
    }
  }
}

// `linear`: out [n, rows] = x [n, cols] @ W^T (+ bias), as DenseWeight.matmul or (float32
// activations) QuantizedLinear.forward.
void linear(const LinearWeights& w, const void* x, int64_t n, int32_t cols, void* out, int32_t rows,
            const DecoderShape& s, int num_threads) {
  if (w.format == WeightFormat::kPackedDense) {
    DenseMatmulArgs args;
    args.out = out;
    args.x = x;
    args.weight = w.weight;
    args.bias = w.bias;
    args.m = n;
    args.n = rows;
    args.k = cols;
    args.x_stride = cols;
    args.out_stride = rows;
    args.dtype = s.dtype;
    args.weight_dtype = w.dense_dtype;
    dense_matmul(args, num_threads);
    return;
  }
  QuantMatmulArgs args;
  args.out = out;
  args.x = x;
  args.weight = static_cast<const uint8_t*>(w.weight);
  args.m = n;
  args.n = rows;
  args.k = cols;
  args.x_stride = cols;
  args.out_stride = rows;
  args.type = w.type;
  args.dtype = DType::kFloat32;  // check(): quantized projections only under float32 activations
  quant_matmul(args, num_threads);
  if (w.bias == nullptr) return;
  float* values = static_cast<float*>(out);
  for (int64_t t = 0; t < n; ++t) {
    float* row = values + t * rows;
    for (int32_t j = 0; j < rows; ++j) row[j] += w.bias[j];
  }
}

// The LoRA layer around a projection: out [n, sum of slices] += the tokens' adapters' updates
// of the projection's input x [n, k] (lora_add), when the step has adapters and the layer a
// table for the projection.
void lora_step(const LoraAdapterWeights* table, const DecoderShape& s, const DecoderBatch& b, const void* x,
               int32_t k, void* out, std::initializer_list<int32_t> slices, int num_threads) {
  if (table == nullptr || b.lora_token_slots == nullptr) return;
  LoraArgs args;
  args.out = out;
  args.x = x;
  args.m = b.num_tokens;
  args.k = k;
  args.x_stride = k;
  args.out_stride = 0;
  args.token_slots = b.lora_token_slots;
  args.slots = table;
  args.num_slots = s.num_lora_slots;
  args.num_slices = 0;
  for (int32_t rows : slices) {
    args.slice_rows[args.num_slices++] = rows;
    args.out_stride += rows;
  }
  args.dtype = s.dtype;
  args.weight_dtype = s.lora_dtype;
  lora_add(args, num_threads);
}

// RMSNorm.forward: without a residual, out = norm(x) and x becomes the residual stream (the
// caller keeps x); with one, residual += x and x = norm(residual) in place.
void rms_norm_step(const void* weight, void* x, void* residual, void* out, int64_t n, const DecoderShape& s,
                   int num_threads) {
  RmsNormArgs args;
  args.out = out;
  args.x = x;
  args.residual = residual;
  args.weight = weight;
  args.num_tokens = n;
  args.hidden_size = s.hidden_size;
  args.eps = s.rms_norm_eps;
  args.dtype = s.dtype;
  rms_norm(args, num_threads);
}

// ops.rms_norm_heads_ on `num_heads` heads of each [n, row_stride] row from `x`: the
// per-head q or k norm of Qwen3Attention / Gemma3Attention.position_qk.
void head_norm_step(const void* weight, void* x, int64_t row_stride, int32_t num_heads, int64_t n,
                    const DecoderShape& s, int num_threads) {
  RmsNormHeadsArgs args;
  args.x = x;
  args.row_stride = row_stride;
  args.weight = weight;
  args.num_tokens = n;
  args.num_heads = num_heads;
  args.head_size = s.head_size;
  args.eps = s.head_norm_eps;
  args.dtype = s.dtype;
  rms_norm_heads(args, num_threads);
}

// LlamaAttention.forward from the normed input `x` to attention output rows `out`
// [n, num_heads * head_size] (the o projection is the caller's).
void attention_step(const DecoderShape& s, const DecoderLayerWeights& layer, const DecoderBatch& b, const void* x,
                    const Rows& qkv, void* out, int num_threads) {
  const int64_t n = b.num_tokens;
  const int32_t q_size = s.num_heads * s.head_size;
  const int32_t kv_size = s.num_kv_heads * s.head_size;
  const int32_t width = q_size + 2 * kv_size;
  linear(layer.qkv, x, n, s.hidden_size, qkv.data, width, s, num_threads);
  lora_step(layer.lora_qkv, s, b, x, s.hidden_size, qkv.data, {q_size, kv_size, kv_size}, num_threads);

  // position_qk: the q heads' norm, the k heads' norm (when the layer has them), then the
  // rotary of both.
  if (layer.q_norm != nullptr) head_norm_step(layer.q_norm, qkv.data, width, s.num_heads, n, s, num_threads);
  if (layer.k_norm != nullptr) head_norm_step(layer.k_norm, qkv.at(0, q_size), width, s.num_kv_heads, n, s, num_threads);
  RotaryArgs rotary;  // rotary.rotate_: query then key heads lead each row
  rotary.x = qkv.data;
  rotary.row_stride = width;
  rotary.positions = b.positions;
  rotary.cos_sin = layer.cos_sin;
  rotary.max_position = layer.max_position;
  rotary.num_tokens = n;
  rotary.num_heads = s.num_heads + s.num_kv_heads;
  rotary.head_size = s.head_size;
  rotary.rotary_dim = layer.rotary_dim;
  rotary.dtype = s.dtype;
  rotary_embedding(rotary, num_threads);

  ReshapeAndCacheArgs cache;  // PagedAttention.forward: ops.reshape_and_cache
  cache.key = qkv.at(0, q_size);
  cache.value = qkv.at(0, q_size + kv_size);
  cache.key_cache = layer.key_cache;
  cache.value_cache = layer.value_cache;
  cache.slot_mapping = b.slot_mapping;
  cache.num_tokens = n;
  cache.key_stride = width;
  cache.value_stride = width;
  cache.dtype = s.dtype;
  cache.cache = s.cache;
  reshape_and_cache(cache, num_threads);

  PagedAttentionArgs attention;  // ops.paged_attention / paged_prefill_attention
  attention.out = out;
  attention.query = qkv.data;
  attention.key_cache = layer.key_cache;
  attention.value_cache = layer.value_cache;
  attention.block_tables = b.block_tables;
  attention.context_lens = b.context_lens;
  attention.query_start_loc = b.query_start_loc;
  attention.draft_queries = b.draft_queries;
  attention.num_seqs = b.num_seqs;
  attention.num_query_tokens = n;
  attention.num_heads = s.num_heads;
  attention.max_blocks_per_seq = b.max_blocks_per_seq;
  attention.max_context_len = b.max_context_len;
  attention.query_stride = width;
  attention.scale = layer.attention_scale;
  attention.dtype = s.dtype;
  attention.cache = s.cache;
  attention.sliding_window = layer.sliding_window;
  attention.logits_soft_cap = layer.logits_soft_cap;
  paged_attention(attention, num_threads);
}

// LlamaMLP.forward (GemmaMLP.forward with kGeluTanh): out [n, hidden] = down(act(gate(x)) * up(x)).
void mlp_step(const DecoderShape& s, const DecoderLayerWeights& layer, const DecoderBatch& b, const void* x,
              void* gate_up, void* activation, void* out, int num_threads) {
  const int64_t n = b.num_tokens;
  const int32_t inter = s.intermediate_size;
  linear(layer.gate_up, x, n, s.hidden_size, gate_up, 2 * inter, s, num_threads);
  lora_step(layer.lora_gate_up, s, b, x, s.hidden_size, gate_up, {inter, inter}, num_threads);
  SiluAndMulArgs act;  // the layout of GeluTanhAndMulArgs too
  act.out = activation;
  act.x = gate_up;
  act.num_tokens = n;
  act.d = inter;
  act.dtype = s.dtype;
  if (s.activation == MlpActivation::kGeluTanh) {
    gelu_tanh_and_mul(act, num_threads);
  } else {
    silu_and_mul(act, num_threads);
  }
  linear(layer.down, activation, n, inter, out, s.hidden_size, s, num_threads);
  lora_step(layer.lora_down, s, b, activation, inter, out, {s.hidden_size}, num_threads);
}

// SharedExpert.forward and shared_expert_gate: y [n, hidden] (this rank's partial sum) and the
// sigmoid's argument gate [n, 1].
void shared_expert_step(const DecoderShape& s, const DecoderLayerWeights& layer, int64_t n, const void* x,
                        Workspace& w, void* y, void* gate, int num_threads) {
  const int32_t inter = s.shared_intermediate_size;
  void* gate_up = sized(w.shared_gate_up, n, 2 * static_cast<int64_t>(inter), s.dtype).data;
  void* activation = sized(w.shared_activation, n, inter, s.dtype).data;
  linear(layer.moe.shared_gate_up, x, n, s.hidden_size, gate_up, 2 * inter, s, num_threads);
  SiluAndMulArgs act;
  act.out = activation;
  act.x = gate_up;
  act.num_tokens = n;
  act.d = inter;
  act.dtype = s.dtype;
  silu_and_mul(act, num_threads);
  linear(layer.moe.shared_down, activation, n, inter, y, s.hidden_size, s, num_threads);
  linear(layer.moe.shared_gate, x, n, s.hidden_size, gate, 1, s, num_threads);
}

// SparseMoeBlock.forward: out [n, hidden] = experts(x, gate(x).float()) (+ the gated shared
// expert, computed first: out may be x, and fused_moe reads every row before it writes one).
void moe_step(const DecoderShape& s, const DecoderLayerWeights& layer, int64_t n, const void* x, Workspace& w,
              void* out, int num_threads) {
  const bool shared = s.shared_intermediate_size > 0;
  void* shared_out = sized(w.shared_out, shared ? n : 0, s.hidden_size, s.dtype).data;
  void* shared_gate = sized(w.shared_gate, shared ? n : 0, 1, s.dtype).data;
  if (shared) shared_expert_step(s, layer, n, x, w, shared_out, shared_gate, num_threads);
  const Rows logits = sized(w.router, n, s.num_experts, s.dtype);
  linear(layer.moe.router, x, n, s.hidden_size, logits.data, s.num_experts, s, num_threads);
  int64_t logits_stride = 0;
  const float* logits32 = float32_rows(s.dtype, logits.data, n, s.num_experts, s.num_experts, w.router_float32,
                                       &logits_stride, num_threads);
  FusedMoeArgs args;
  args.out = out;
  args.x = x;
  args.router_logits = logits32;
  args.m = n;
  args.hidden = s.hidden_size;
  args.intermediate = s.intermediate_size;
  args.num_experts = s.num_experts;
  args.top_k = s.top_k;
  args.renormalize = s.renormalize;
  args.x_stride = s.hidden_size;
  args.out_stride = s.hidden_size;
  args.dtype = s.dtype;
  args.w1 = layer.moe.w1;
  args.w3 = layer.moe.w3;
  args.w2 = layer.moe.w2;
  fused_moe(args, num_threads);
  if (!shared) return;
  SigmoidGatedAddArgs add;
  add.out = out;
  add.y = shared_out;
  add.gate = shared_gate;
  add.num_tokens = n;
  add.d = s.hidden_size;
  add.dtype = s.dtype;
  sigmoid_gated_add(add, num_threads);
}

}  // namespace

void decoder_forward(const DecoderShape& s, const DecoderLayerWeights* layers, int32_t num_layers,
                     const DecoderBatch& b, int num_threads) {
  check(s, layers, num_layers, b);
  const int64_t n = b.num_tokens;
  if (n == 0) return;
  Workspace& w = Workspace::of_this_thread();
  const int32_t q_size = s.num_heads * s.head_size;
  const Rows residual = sized(w.residual, n, s.hidden_size, s.dtype);
  void* hidden = sized(w.hidden, n, s.hidden_size, s.dtype).data;
  const Rows qkv = sized(w.qkv, n, q_size + 2 * s.num_kv_heads * s.head_size, s.dtype);
  void* attention = sized(w.attention, n, q_size, s.dtype).data;
  const bool moe = s.mlp == MlpKind::kSparseMoe;  // the experts' buffers are fused_moe's own
  void* gate_up = sized(w.gate_up, moe ? 0 : n, 2 * static_cast<int64_t>(s.intermediate_size), s.dtype).data;
  void* activation = sized(w.activation, moe ? 0 : n, s.intermediate_size, s.dtype).data;

  // Layer 0's input norm has no residual yet: the embeddings become the residual stream.
  std::memcpy(residual.data, b.embeddings, static_cast<size_t>(n * s.hidden_size * residual.element));
  rms_norm_step(layers[0].input_norm, residual.data, nullptr, hidden, n, s, num_threads);
  const bool gemma = s.structure == DecoderStructure::kGemma;
  for (int32_t i = 0; i < num_layers; ++i) {
    const DecoderLayerWeights& layer = layers[i];
    if (i > 0) rms_norm_step(layer.input_norm, hidden, residual.data, hidden, n, s, num_threads);
    attention_step(s, layer, b, hidden, qkv, attention, num_threads);
    linear(layer.o, attention, n, q_size, hidden, s.hidden_size, s, num_threads);
    lora_step(layer.lora_o, s, b, attention, q_size, hidden, {s.hidden_size}, num_threads);
    if (gemma) {
      // GemmaDecoderLayer.forward: post_attention_layernorm.normed_ (in place, no residual),
      // then the pre-feedforward norm takes the residual add.
      rms_norm_step(layer.post_attention_norm, hidden, nullptr, hidden, n, s, num_threads);
      rms_norm_step(layer.pre_feedforward_norm, hidden, residual.data, hidden, n, s, num_threads);
    } else {
      rms_norm_step(layer.post_attention_norm, hidden, residual.data, hidden, n, s, num_threads);
    }
    if (moe) {
      moe_step(s, layer, n, hidden, w, hidden, num_threads);
    } else {
      mlp_step(s, layer, b, hidden, gate_up, activation, hidden, num_threads);
    }
    if (gemma) rms_norm_step(layer.post_feedforward_norm, hidden, nullptr, hidden, n, s, num_threads);
  }
  rms_norm_step(s.final_norm, hidden, residual.data, b.out, n, s, num_threads);
}

}  // namespace vpage::cpu
