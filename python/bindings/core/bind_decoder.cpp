// vpage._core._CpuDecoder: the C++ layer loop of a Llama- or Gemma-structured model on the CPU
// (decoder_forward.h), built once from the model's weight and KV cache pointers (Python ints)
// by vpage.model_executor.models.cpu_decoder, which keeps the tensors alive.
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings.h"
#include "vpage/kernels/decoder_forward.h"

namespace py = pybind11;

namespace vpage::bindings {
namespace {

template <class T = uintptr_t>
T field(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw py::value_error(std::string("_CpuDecoder: layer entry lacks '") + key + "'");
  return d[key].cast<T>();
}

// An optional entry: 0 when the dict lacks it.
uintptr_t optional_field(const py::dict& d, const char* key) { return d.contains(key) ? d[key].cast<uintptr_t>() : 0; }

LinearWeights linear_of(const py::dict& d, const std::string& name) {
  LinearWeights w;
  w.weight = ptr<const void>(field(d, (name + "_weight").c_str()));
  w.format = static_cast<WeightFormat>(field<int32_t>(d, (name + "_format").c_str()));
  w.bias = ptr<const float>(field(d, (name + "_bias").c_str()));
  if (w.format == WeightFormat::kPackedDense) {
    w.dense_dtype = static_cast<DType>(field<int32_t>(d, (name + "_dtype").c_str()));
    return w;
  }
  if (w.format != WeightFormat::kQuantized) {
    throw py::value_error("_CpuDecoder: " + name + " has unknown weight format " +
                          std::to_string(static_cast<int32_t>(w.format)));
  }
  w.type = static_cast<QuantType>(field(d, (name + "_type").c_str()));
  if (!quant_type_supported(static_cast<int32_t>(w.type))) {
    throw py::value_error("_CpuDecoder: " + name + " has unsupported ggml type " +
                          std::to_string(static_cast<int32_t>(w.type)));
  }
  return w;
}

// An expert stack's entries: <name>_data, <name>_expert_bytes, <name>_type (ggml type id, or
// -1 for packed float panels), <name>_dtype (the panels').
MoeExpertWeights experts_of(const py::dict& d, const std::string& name) {
  MoeExpertWeights w;
  w.data = ptr<const void>(field(d, (name + "_data").c_str()));
  w.expert_bytes = field<int64_t>(d, (name + "_expert_bytes").c_str());
  const int32_t type = field<int32_t>(d, (name + "_type").c_str());
  w.quantized = type >= 0;
  if (w.quantized) w.qtype = static_cast<QuantType>(type);
  w.dtype = static_cast<DType>(field<int32_t>(d, (name + "_dtype").c_str()));
  return w;
}

class CpuDecoder {
 public:
  CpuDecoder(const DecoderShape& shape, const std::vector<py::dict>& layers) : shape_(shape) {
    for (const py::dict& d : layers) {
      DecoderLayerWeights l;
      l.input_norm = ptr<const void>(field(d, "input_norm"));
      l.qkv = linear_of(d, "qkv");
      l.q_norm = ptr<const void>(field(d, "q_norm"));
      l.k_norm = ptr<const void>(field(d, "k_norm"));
      l.o = linear_of(d, "o");
      l.post_attention_norm = ptr<const void>(field(d, "post_attention_norm"));
      l.pre_feedforward_norm = ptr<const void>(field(d, "pre_feedforward_norm"));
      if (shape.mlp == MlpKind::kSparseMoe) {
        l.moe.router = linear_of(d, "router");
        l.moe.w1 = experts_of(d, "w1");
        l.moe.w3 = experts_of(d, "w3");
        l.moe.w2 = experts_of(d, "w2");
        if (shape.shared_intermediate_size > 0) {
          l.moe.shared_gate_up = linear_of(d, "shared_gate_up");
          l.moe.shared_down = linear_of(d, "shared_down");
          l.moe.shared_gate = linear_of(d, "shared_gate");
        }
      } else {
        l.gate_up = linear_of(d, "gate_up");
        l.down = linear_of(d, "down");
      }
      l.post_feedforward_norm = ptr<const void>(field(d, "post_feedforward_norm"));
      l.cos_sin = ptr<const float>(field(d, "cos_sin"));
      l.max_position = field<int64_t>(d, "max_position");
      l.rotary_dim = field<int32_t>(d, "rotary_dim");
      l.attention_scale = field<float>(d, "attention_scale");
      l.sliding_window = field<int32_t>(d, "sliding_window");
      l.logits_soft_cap = field<float>(d, "logits_soft_cap");
      l.key_cache = ptr<void>(field(d, "key_cache"));
      l.value_cache = ptr<void>(field(d, "value_cache"));
      l.lora_qkv = ptr<const LoraAdapterWeights>(optional_field(d, "lora_qkv"));
      l.lora_o = ptr<const LoraAdapterWeights>(optional_field(d, "lora_o"));
      l.lora_gate_up = ptr<const LoraAdapterWeights>(optional_field(d, "lora_gate_up"));
      l.lora_down = ptr<const LoraAdapterWeights>(optional_field(d, "lora_down"));
      layers_.push_back(l);
    }
  }

  void forward(const DecoderBatch& batch, int num_threads) const {
    cpu::decoder_forward(shape_, layers_.data(), static_cast<int32_t>(layers_.size()), batch, num_threads);
  }

 private:
  DecoderShape shape_;
  std::vector<DecoderLayerWeights> layers_;
};

}  // namespace

void bind_decoder(py::module_& m) {
  py::class_<CpuDecoder>(m, "_CpuDecoder")
      .def(py::init([](int32_t structure, int32_t activation, int32_t hidden_size, int32_t num_heads,
                       int32_t num_kv_heads, int32_t head_size, int32_t intermediate_size, float rms_norm_eps,
                       float head_norm_eps, uintptr_t final_norm, int64_t num_blocks, int32_t block_size,
                       int32_t dtype, int32_t cache_dtype, const std::vector<py::dict>& layers, int32_t mlp,
                       int32_t num_experts, int32_t top_k, bool renormalize, int32_t shared_intermediate_size,
                       int32_t num_lora_slots, int32_t lora_dtype) {
             DecoderShape s;
             s.num_lora_slots = num_lora_slots;
             s.lora_dtype = static_cast<DType>(lora_dtype);
             s.mlp = static_cast<MlpKind>(mlp);
             s.num_experts = num_experts;
             s.top_k = top_k;
             s.renormalize = renormalize;
             s.shared_intermediate_size = shared_intermediate_size;
             s.structure = static_cast<DecoderStructure>(structure);
             s.activation = static_cast<MlpActivation>(activation);
             s.hidden_size = hidden_size;
             s.num_heads = num_heads;
             s.num_kv_heads = num_kv_heads;
             s.head_size = head_size;
             s.intermediate_size = intermediate_size;
             s.rms_norm_eps = rms_norm_eps;
             s.head_norm_eps = head_norm_eps;
             s.final_norm = ptr<const void>(final_norm);
             s.dtype = static_cast<DType>(dtype);
             s.cache = CacheShape{num_blocks, num_kv_heads, head_size, block_size, static_cast<DType>(cache_dtype)};
             return CpuDecoder(s, layers);
           }),
           py::arg("structure"), py::arg("activation"), py::arg("hidden_size"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_size"), py::arg("intermediate_size"), py::arg("rms_norm_eps"),
           py::arg("head_norm_eps"), py::arg("final_norm"), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("dtype"), py::arg("cache_dtype"), py::arg("layers"), py::arg("mlp") = 0,
           py::arg("num_experts") = 0, py::arg("top_k") = 0, py::arg("renormalize") = false,
           py::arg("shared_intermediate_size") = 0, py::arg("num_lora_slots") = 0, py::arg("lora_dtype") = 0,
           "structure: 0 Llama, 1 Gemma (norms before and after each block); activation: 0 SiLU,\n"
           "1 GELU(tanh). layers: one dict per layer of pointers (ints; 0 = none where optional):\n"
           "input_norm, q_norm, k_norm (optional), post_attention_norm, pre_feedforward_norm and\n"
           "post_feedforward_norm (Gemma only), cos_sin, key_cache, value_cache, and for each of qkv, o,\n"
           "gate_up, down: <name>_weight, <name>_format (0 GGUF blocks, 1 packed dense), <name>_type (ggml\n"
           "type id, blocks) or <name>_dtype (packed dense), <name>_bias (float32, 0 = none); and values:\n"
           "max_position (rows of cos_sin), rotary_dim, attention_scale, sliding_window (0 = none),\n"
           "logits_soft_cap (0 = none). dtype (activations and norms) and cache_dtype: 0 float32,\n"
           "1 float16, 2 bfloat16; GGUF blocks need float32 activations. mlp: 0 gated (gate_up, down),\n"
           "1 sparse MoE: router (a projection's entries) and the expert stacks w1, w3, w2 (<name>_data,\n"
           "<name>_expert_bytes, <name>_type: ggml type id or -1 for packed float, <name>_dtype), routed\n"
           "to top_k of num_experts, renormalize as fused_moe; with shared_intermediate_size, also\n"
           "shared_gate_up, shared_down and shared_gate (projections' entries). LoRA (optional entries,\n"
           "0 or absent = none): lora_qkv, lora_o, lora_gate_up, lora_down, each an int64 [num_lora_slots, 5]\n"
           "table (ops.lora_add) of adapters packed in lora_dtype; gate_up and down only on a gated MLP.")
      .def(
          "forward",
          [](const CpuDecoder& self, uintptr_t embeddings, uintptr_t out, uintptr_t positions, uintptr_t slot_mapping,
             uintptr_t block_tables, uintptr_t context_lens, uintptr_t query_start_loc, int64_t num_tokens,
             int32_t num_seqs, int32_t max_blocks_per_seq, int32_t max_context_len, int num_threads,
             bool draft_queries, uintptr_t lora_token_slots) {
            DecoderBatch b;
            b.embeddings = ptr<const void>(embeddings);
            b.out = ptr<void>(out);
            b.positions = ptr<const int64_t>(positions);
            b.slot_mapping = ptr<const int64_t>(slot_mapping);
            b.block_tables = ptr<const int32_t>(block_tables);
            b.context_lens = ptr<const int32_t>(context_lens);
            b.query_start_loc = ptr<const int32_t>(query_start_loc);
            b.num_tokens = num_tokens;
            b.num_seqs = num_seqs;
            b.max_blocks_per_seq = max_blocks_per_seq;
            b.max_context_len = max_context_len;
            b.draft_queries = draft_queries;
            b.lora_token_slots = ptr<const int32_t>(lora_token_slots);
            py::gil_scoped_release release;
            self.forward(b, num_threads);
          },
          py::arg("embeddings"), py::arg("out"), py::arg("positions"), py::arg("slot_mapping"),
          py::arg("block_tables"), py::arg("context_lens"), py::arg("query_start_loc"), py::arg("num_tokens"),
          py::arg("num_seqs"), py::arg("max_blocks_per_seq"), py::arg("max_context_len"), py::arg("num_threads"),
          py::arg("draft_queries") = false, py::arg("lora_token_slots") = 0,
          "Every layer and the final norm over one step (query_start_loc 0 = decode); writes out\n"
          "[num_tokens, hidden_size] and the step's K/V into each layer's cache. draft_queries: rows of\n"
          "several tokens are a decode token and its draft tokens, scored as decode steps would.\n"
          "lora_token_slots: int32 [num_tokens], each token's LoRA slot (-1 = none), or 0: no adapter.");
}

}  // namespace vpage::bindings
