// ModelConfig: what the forward pass needs from a Hugging Face config.json, for every model family MoEX
// runs (families.h; docs/model.md). Each family's HF fields are mapped
// onto the options below or refused: anything MoEX cannot run exactly (sliding windows, rope scaling,
// MLA attention, o_proj biases) is an error rather than a silent approximation.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moex/model/families.h"
#include "moex/model/quantization.h"

namespace moex {

// The family's declaration (families.h).
const FamilyInfo& family_info(ModelFamily family);
// Throws Error(kInvalidInput) naming the supported model types (and why deepseek_v2/v3 are refused).
ModelFamily family_from_model_type(const std::string& model_type, const std::string& origin);

struct ModelConfig {
  ModelFamily family = ModelFamily::kMixtral;
  std::string model_type = "mixtral";
  int vocab_size = 32000;
  int hidden_size = 4096;          // d
  int intermediate_size = 14336;   // per-expert FFN width (HF: mixtral/olmoe intermediate_size, else moe_intermediate_size)
  int num_hidden_layers = 32;
  int num_attention_heads = 32;
  int num_key_value_heads = 8;
  int head_dim = 128;              // hidden_size / num_attention_heads unless config.json says otherwise
  int num_local_experts = 8;       // E (HF: num_local_experts, num_experts, n_routed_experts)
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

  // Family options (defaults: Mixtral, which has none of them).
  bool qkv_bias = false;                 // q/k/v_proj have biases (qwen2_moe); o_proj never does
  QkNorm qk_norm = QkNorm::kNone;
  RouterScoring scoring = RouterScoring::kSoftmax;
  int n_group = 1, topk_group = 1;       // grouped top-k (sigmoid router): E/n_group experts per group
  float routed_scaling_factor = 1.0f;    // routing weights times this (sigmoid router)
  int shared_expert_intermediate_size = 0;  // 0: no shared expert; dots1: moe_intermediate x n_shared_experts
  int n_shared_experts = 0;              // dots1 (kept to write config.json back)
  bool shared_expert_gate = false;       // qwen2_moe: shared output times sigmoid(x w_sg^T), w_sg [1, d]
  int dense_intermediate_size = 0;       // width of the dense MLP layers (HF intermediate_size, non-mixtral)
  std::vector<int> mlp_only_layers;      // qwen: these layers are dense
  int decoder_sparse_step = 1;           // qwen: layer l is MoE when (l + 1) % step == 0
  int first_k_dense_replace = 0;         // dots1: layers below this are dense
  int pad_token_id = -1;                 // -1: none; only written back
  bool has_bos = true;                   // olmoe ships bos_token_id null

  const FamilyInfo& info() const { return family_info(family); }
  // Whether layer l runs the MoE block (else the dense MLP of width dense_intermediate_size).
  bool moe_layer(int layer) const;

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
