// ModelConfig: the fields of Hugging Face's MixtralConfig that the forward pass uses, read from
// config.json. Anything MoEX cannot run exactly (another model_type, sliding windows, biases) is an
// error rather than a silent approximation.
#pragma once
#include <cstdint>
#include <string>

#include "moex/model/quantization.h"

namespace moex {

struct ModelConfig {
  std::string model_type = "mixtral";
  int vocab_size = 32000;
  int hidden_size = 4096;          // d
  int intermediate_size = 14336;   // per-expert FFN width
  int num_hidden_layers = 32;
  int num_attention_heads = 32;
  int num_key_value_heads = 8;
  int head_dim = 128;              // hidden_size / num_attention_heads unless config.json says otherwise
  int num_local_experts = 8;       // E
  int num_experts_per_tok = 2;     // k
  float rms_norm_eps = 1e-5f;
  float rope_theta = 1e6f;
  int max_position_embeddings = 32768;
  bool tie_word_embeddings = false;
  bool norm_topk_prob = true;      // true: softmax over the chosen k (Mixtral); false: softmax over all E
  float router_aux_loss_coef = 0.02f;  // training only; kept so a written config round-trips
  int bos_token_id = 1;
  int eos_token_id = 2;
  std::string torch_dtype = "bfloat16";
  QuantizationConfig quantization;  // "quantization_config": the checkpoint's quantized modules (none by default)

  int q_dim() const { return num_attention_heads * head_dim; }
  int kv_dim() const { return num_key_value_heads * head_dim; }
  // Parameters (not bytes) of the weights one decoded token reads: attention, router, k experts,
  // norms and lm_head (the embedding row is one row, counted as such).
  int64_t active_params_per_token() const;
  int64_t total_params() const;
};

// Parses and validates config.json; throws Error(kInvalidInput) with one line naming the field.
ModelConfig load_model_config(const std::string& path);
ModelConfig parse_model_config(const std::string& json_text, const std::string& origin);
// HF-style config.json text for the config (what gen-model writes).
std::string model_config_to_json(const ModelConfig& config);
// Checks internal consistency (divisibility, k <= E, positive sizes); throws naming the constraint.
void validate_model_config(const ModelConfig& config);

}  // namespace moex
