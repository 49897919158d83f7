// A whole decoder pass of few rows in one call from Python: the CPU's counterpart of a CUDA
// graph. At batch 1 a SmolLM2 token makes ~10 kernel calls per layer (norms, four products,
// RoPE, the K/V store, attention, SiLU-and-mul), 300 a token, and each call from Python costs
// microseconds of interpreter and argument conversion beyond its kernel: ~1 ms of a ~4.7 ms int4
// token (2-core EPYC). Here the layers' loop runs in C++ and calls the same kernels in the same
// order with the same arguments as llama.py's LlamaDecoderLayer.forward with its few-row calls
// bound, so its outputs are bit-identical to that path (tests/test_cpu_decode_step.py).
//
// Included by cpu_fused_ops.cpp after its ops (it calls rms_norm, add_rms_norm, rope_, silu_mul
// and the three linear kernels directly); attention comes from the other extension through the
// function table of cpu_attention_api.h. engine/runner/models/decode_step.py builds it.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cpu_attention_api.h"

// Hidden like pybind11's own types: the classes bound below would otherwise be more visible
// than their pybind11 bases (a GCC warning), and nothing outside this extension links to them.
namespace __attribute__((visibility("hidden"))) cpu_decode_step {

// One linear layer's product y = x @ W.T as its few-row kernel computes it, weights bound.
struct Linear {
  enum class Kind { PackedBf16, Int8, Int4 };
  Kind kind;
  torch::Tensor weight;  // the packed bf16 buffer (kept alive) / int8 qweight / int4 packed
  torch::Tensor params;  // int8: per-row scales; int4: scale_and_zero; bf16: unused
  int64_t address = 0;   // packed bf16: the buffer's data (torch.ops.mkldnn.data_ptr)
  int64_t out_features = 0, in_features = 0, group_size = 0;
  int64_t int8_activations_min_rows = 0;  // int8/int4: the switch to int8 activations

  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind) {
      case Kind::PackedBf16: return packed_bf16_linear(x, address, out_features, in_features);
      case Kind::Int8: return int8_linear(x, weight, params, int8_activations_min_rows);
      case Kind::Int4:
        return int4_linear(x, weight, params, group_size, int8_activations_min_rows);
    }
    TORCH_CHECK(false, "unknown linear kind");
  }
};

inline Linear packed_bf16_call(torch::Tensor packed, int64_t address, int64_t out_features,
                        int64_t in_features) {
  return {Linear::Kind::PackedBf16, std::move(packed), {}, address, out_features, in_features};
}
inline Linear int8_call(torch::Tensor qweight, torch::Tensor scales,
                        int64_t int8_activations_min_rows) {
  const int64_t n = qweight.size(0), k = qweight.size(1);
  return {Linear::Kind::Int8, std::move(qweight), std::move(scales), 0, n, k, 0,
          int8_activations_min_rows};
}
inline Linear int4_call(torch::Tensor packed, torch::Tensor scale_and_zero, int64_t group_size,
                        int64_t int8_activations_min_rows) {
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  return {Linear::Kind::Int4, std::move(packed), std::move(scale_and_zero), 0, n, k, group_size,
          int8_activations_min_rows};
}

struct Layer {
  torch::Tensor norm1_weight;
  double norm1_eps;
  Linear qkv, o;
  torch::Tensor norm2_weight;
  double norm2_eps;
  Linear gate_up, down;
};

class DecodeStep {
 public:
  // attention_api: cpu_paged_attention's api() capsule. scale: the softmax scale.
  DecodeStep(const pybind11::capsule& attention_api, int64_t num_heads, int64_t num_kv_heads,
             int64_t head_dim, double scale, torch::Tensor final_norm_weight,
             double final_norm_eps)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale),
        final_norm_weight_(std::move(final_norm_weight)), final_norm_eps_(final_norm_eps) {
    const char* name = attention_api.name();
    TORCH_CHECK_VALUE(name != nullptr && std::string(name) == cpu_attention_api::CAPSULE_NAME,
                      "attention_api: a ", cpu_attention_api::CAPSULE_NAME,
                      " capsule expected, got ", name ? name : "an unnamed one",
                      " (rebuild the CPU kernels)");
    api_ = attention_api.get_pointer<cpu_attention_api::Api>();
    TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
                          head_dim > 0 && head_dim % 2 == 0,
                      "heads: ", num_heads, " query heads over ", num_kv_heads,
                      " KV heads of an even head_dim ", head_dim, " expected");
  }

  void add_layer(torch::Tensor norm1_weight, double norm1_eps, Linear qkv, Linear o,
                 torch::Tensor norm2_weight, double norm2_eps, Linear gate_up, Linear down) {
    const int64_t qkv_out = (num_heads_ + 2 * num_kv_heads_) * head_dim_;
    TORCH_CHECK_VALUE(qkv.out_features == qkv_out && o.in_features == num_heads_ * head_dim_ &&
                          gate_up.out_features == 2 * down.in_features,
                      "layer ", layers_.size(), ": qkv of ", qkv_out, " outputs, o of ",
                      num_heads_ * head_dim_, " inputs and gate_up twice down's inputs expected");
    layers_.push_back({std::move(norm1_weight), norm1_eps, std::move(qkv), std::move(o),
                       std::move(norm2_weight), norm2_eps, std::move(gate_up), std::move(down)});
  }

  // hidden: the embeddings [T, hidden] (the residual stream's start; updated in place).
  // positions int64 [T]; cos/sin float32 [max_positions, D/2]; keys/values: each layer's
  // head-major 16/32-bit cache [Hkv, blocks, block_size, D]; the rest is the attention
  // metadata (CpuAttentionMetadata). Returns the final normed hidden states [T, hidden].
  torch::Tensor forward(torch::Tensor hidden, torch::Tensor positions, torch::Tensor cos,
                        torch::Tensor sin, const std::vector<torch::Tensor>& keys,
                        const std::vector<torch::Tensor>& values, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor seq_lens,
                        torch::Tensor query_start_loc) const {
    TORCH_CHECK_VALUE(!layers_.empty(), "decode step: no layers added");
    TORCH_CHECK_VALUE(keys.size() == layers_.size() && values.size() == layers_.size(),
                      "keys/values: one cache per layer (", layers_.size(), ") expected, got ",
                      keys.size(), " / ", values.size());
    TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.size(0) > 0,
                      "hidden: [tokens, hidden] with at least one token expected, got ",
                      hidden.sizes());
    const int64_t T = hidden.size(0), H = num_heads_, Hkv = num_kv_heads_, D = head_dim_;
    torch::Tensor residual = hidden, x;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      x = i == 0 ? rms_norm(hidden, layer.norm1_weight, layer.norm1_eps)
                 : add_rms_norm(hidden, residual, layer.norm1_weight, layer.norm1_eps);
      // q, k and v from one product; RoPE on q and k in place.
      torch::Tensor qkv = layer.qkv(x);
      rope_(qkv, positions, cos, sin, H + Hkv, D);
      torch::Tensor qk = qkv.narrow(1, 0, (H + Hkv) * D).view({T, H + Hkv, D});
      torch::Tensor q = qk.narrow(1, 0, H), k = qk.narrow(1, H, Hkv);
      torch::Tensor v = qkv.narrow(1, (H + Hkv) * D, Hkv * D).view({T, Hkv, D});
      api_->store_kv(keys[i], values[i], k, v, slot_mapping);
      torch::Tensor attn = at::empty({T, H, D}, q.options());
      api_->paged_attention(attn, q, keys[i].permute({1, 2, 0, 3}),
                            values[i].permute({1, 2, 0, 3}), block_tables, seq_lens,
                            query_start_loc, scale_, c10::nullopt, c10::nullopt);
      x = add_rms_norm(layer.o(attn.view({T, H * D})), residual, layer.norm2_weight,
                       layer.norm2_eps);
      hidden = layer.down(silu_mul(layer.gate_up(x)));
    }
    return add_rms_norm(hidden, residual, final_norm_weight_, final_norm_eps_);
  }

 private:
  const cpu_attention_api::Api* api_ = nullptr;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  torch::Tensor final_norm_weight_;
  double final_norm_eps_;
  std::vector<Layer> layers_;
};

}  // namespace cpu_decode_step
