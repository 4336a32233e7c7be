#include "moex/model/config.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/base/small_file.h"

namespace moex {
namespace {

using json = nlohmann::json;

// Fields HF writes into a MixtralConfig that do not change inference, or that we check explicitly.
// Any other field is unknown: a config from a newer or different architecture must not load silently.
const std::set<std::string>& known_fields() {
  static const std::set<std::string> fields = {
      "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok",
      "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "norm_topk_prob",
      "router_aux_loss_coef", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "hidden_act",
      "initializer_range", "use_cache", "output_router_logits", "sliding_window", "attention_dropout",
      "router_jitter_noise", "transformers_version", "rope_scaling", "attention_bias", "_name_or_path",
      "quantization_config"};
  return fields;
}

template <typename T>
T get_field(const json& j, const char* name, const std::string& origin, bool required, T fallback) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) {
    MOEX_CHECK_INPUT(!required, origin, ": missing required field \"", name, "\"");
    return fallback;
  }
  if constexpr (std::is_same_v<T, int>) {
    // nlohmann's get<int>() would truncate 1.9 to 1, read true as 1 and wrap 4294967808 to 512.
    MOEX_CHECK_INPUT(it->is_number(), origin, ": field \"", name, "\" has the wrong type (", it->type_name(),
                     "), expected an integer");
    MOEX_CHECK_INPUT(it->is_number_integer(), origin, ": field \"", name, "\" must be an integer, got ", it->dump());
    const bool in_range = it->is_number_unsigned()
                              ? it->get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int>::max())
                              : it->get<int64_t>() >= std::numeric_limits<int>::min() &&
                                    it->get<int64_t>() <= std::numeric_limits<int>::max();
    MOEX_CHECK_INPUT(in_range, origin, ": field \"", name, "\" = ", it->dump(), " is out of range (at most ",
                     std::numeric_limits<int>::max(), ")");
    return static_cast<int>(it->get<int64_t>());
  } else if constexpr (std::is_same_v<T, float>) {
    MOEX_CHECK_INPUT(it->is_number(), origin, ": field \"", name, "\" has the wrong type (", it->type_name(),
                     "), expected a number");
    const double value = it->get<double>();
    MOEX_CHECK_INPUT(std::isfinite(value) && std::fabs(value) <= std::numeric_limits<float>::max(), origin,
                     ": field \"", name, "\" = ", it->dump(), " is not a finite 32-bit float");
    return static_cast<float>(value);
  } else {
    try {
      return it->get<T>();
    } catch (const json::exception&) {
      throw_error(ErrorKind::kInvalidInput,
                  origin + ": field \"" + name + "\" has the wrong type (" + it->type_name() + ")");
    }
  }
}

}  // namespace

int64_t ModelConfig::active_params_per_token() const {
  const int64_t d = hidden_size;
  const int64_t attention = d * q_dim() + 2 * d * kv_dim() + q_dim() * d;
  const int64_t experts = int64_t{num_experts_per_tok} * 3 * d * intermediate_size;
  const int64_t router = int64_t{num_local_experts} * d;
  return num_hidden_layers * (attention + experts + router + 2 * d) + d + int64_t{vocab_size} * d + d;
}

int64_t ModelConfig::total_params() const {
  const int64_t d = hidden_size;
  const int64_t attention = d * q_dim() + 2 * d * kv_dim() + q_dim() * d;
  const int64_t experts = int64_t{num_local_experts} * 3 * d * intermediate_size;
  const int64_t router = int64_t{num_local_experts} * d;
  const int64_t embeddings = int64_t{vocab_size} * d * (tie_word_embeddings ? 1 : 2);
  return num_hidden_layers * (attention + experts + router + 2 * d) + d + embeddings;
}

void validate_model_config(const ModelConfig& c) {
  MOEX_CHECK_INPUT(c.model_type == "mixtral", "config: model_type \"", c.model_type,
                   "\" is not supported (MoEX runs model_type \"mixtral\")");
  MOEX_CHECK_INPUT(c.vocab_size > 0 && c.hidden_size > 0 && c.intermediate_size > 0 && c.num_hidden_layers > 0 &&
                       c.num_attention_heads > 0 && c.num_key_value_heads > 0 && c.head_dim > 0,
                   "config: sizes must be positive");
  MOEX_CHECK_INPUT(c.num_attention_heads % c.num_key_value_heads == 0, "config: num_attention_heads (",
                   c.num_attention_heads, ") must be a multiple of num_key_value_heads (", c.num_key_value_heads, ")");
  MOEX_CHECK_INPUT(c.head_dim % 2 == 0, "config: head_dim (", c.head_dim, ") must be even for RoPE");
  MOEX_CHECK_INPUT(c.num_local_experts > 0 && c.num_experts_per_tok > 0 && c.num_experts_per_tok <= c.num_local_experts,
                   "config: num_experts_per_tok (", c.num_experts_per_tok, ") must be in 1..num_local_experts (",
                   c.num_local_experts, ")");
  // NaN fails every comparison: "!(x > 0)" rejects it with the negatives.
  MOEX_CHECK_INPUT(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0, "config: rms_norm_eps (", c.rms_norm_eps,
                   ") must be finite and positive");
  MOEX_CHECK_INPUT(std::isfinite(c.rope_theta) && c.rope_theta > 0, "config: rope_theta (", c.rope_theta,
                   ") must be finite and positive");
  MOEX_CHECK_INPUT(std::isfinite(c.router_aux_loss_coef) && c.router_aux_loss_coef >= 0,
                   "config: router_aux_loss_coef (", c.router_aux_loss_coef, ") must be finite and >= 0");
  MOEX_CHECK_INPUT(c.max_position_embeddings > 0, "config: max_position_embeddings must be positive");
  MOEX_CHECK_INPUT(c.bos_token_id >= 0 && c.bos_token_id < c.vocab_size && c.eos_token_id >= 0 &&
                       c.eos_token_id < c.vocab_size,
                   "config: bos_token_id (", c.bos_token_id, ") and eos_token_id (", c.eos_token_id,
                   ") must be token ids below vocab_size (", c.vocab_size, ")");
  // Widths are ints and products of them index buffers: keep every product the code forms in range.
  const int64_t int_max = std::numeric_limits<int>::max();
  MOEX_CHECK_INPUT(int64_t{c.num_attention_heads} * c.head_dim <= int_max, "config: num_attention_heads x head_dim (",
                   int64_t{c.num_attention_heads} * c.head_dim, ") is out of range");
  const double d = c.hidden_size, q = double(c.num_attention_heads) * c.head_dim,
               kv = double(c.num_key_value_heads) * c.head_dim;
  const double params = c.num_hidden_layers * (2 * d * q + 2 * d * kv + double(c.num_local_experts) *
                                                                            (3 * d * c.intermediate_size + d)) +
                        2.0 * c.vocab_size * d;
  MOEX_CHECK_INPUT(params < 1e15, "config: the sizes give ", params, " parameters, more than any checkpoint MoEX loads");
}

ModelConfig parse_model_config(const std::string& text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw_error(ErrorKind::kInvalidInput, origin + ": not valid JSON (" + e.what() + ")");
  }
  MOEX_CHECK_INPUT(j.is_object(), origin, ": expected a JSON object");
  for (const auto& [key, value] : j.items()) {
    MOEX_CHECK_INPUT(known_fields().count(key), origin, ": unknown field \"", key,
                     "\" (MoEX loads Mixtral configs; remove the field if it does not change the model)");
  }
  ModelConfig c;
  c.model_type = get_field<std::string>(j, "model_type", origin, true, "");
  MOEX_CHECK_INPUT(c.model_type == "mixtral", origin, ": model_type \"", c.model_type,
                   "\" is not supported (MoEX runs model_type \"mixtral\")");
  c.vocab_size = get_field<int>(j, "vocab_size", origin, true, 0);
  c.hidden_size = get_field<int>(j, "hidden_size", origin, true, 0);
  c.intermediate_size = get_field<int>(j, "intermediate_size", origin, true, 0);
  c.num_hidden_layers = get_field<int>(j, "num_hidden_layers", origin, true, 0);
  c.num_attention_heads = get_field<int>(j, "num_attention_heads", origin, true, 0);
  c.num_key_value_heads = get_field<int>(j, "num_key_value_heads", origin, false, c.num_attention_heads);
  MOEX_CHECK_INPUT((c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads == 0) || j.contains("head_dim"),
                   origin, ": hidden_size (", c.hidden_size, ") is not divisible by num_attention_heads (",
                   c.num_attention_heads, ") and no head_dim is given");
  c.head_dim = get_field<int>(j, "head_dim", origin, false,
                              c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
  c.num_local_experts = get_field<int>(j, "num_local_experts", origin, true, 0);
  c.num_experts_per_tok = get_field<int>(j, "num_experts_per_tok", origin, true, 0);
  c.rms_norm_eps = get_field<float>(j, "rms_norm_eps", origin, false, 1e-5f);
  c.rope_theta = get_field<float>(j, "rope_theta", origin, false, 1e6f);
  c.max_position_embeddings = get_field<int>(j, "max_position_embeddings", origin, false, 32768);
  c.tie_word_embeddings = get_field<bool>(j, "tie_word_embeddings", origin, false, false);
  c.norm_topk_prob = get_field<bool>(j, "norm_topk_prob", origin, false, true);
  c.router_aux_loss_coef = get_field<float>(j, "router_aux_loss_coef", origin, false, 0.02f);
  c.bos_token_id = get_field<int>(j, "bos_token_id", origin, false, 1);
  c.eos_token_id = get_field<int>(j, "eos_token_id", origin, false, 2);
  c.torch_dtype = get_field<std::string>(j, "torch_dtype", origin, false, "bfloat16");
  const std::string act = get_field<std::string>(j, "hidden_act", origin, false, "silu");
  MOEX_CHECK_INPUT(act == "silu", origin, ": hidden_act \"", act, "\" is not supported (Mixtral uses silu)");
  MOEX_CHECK_INPUT(!j.contains("rope_scaling") || j["rope_scaling"].is_null(), origin,
                   ": rope_scaling is not supported; remove it or set it to null");
  MOEX_CHECK_INPUT(!get_field<bool>(j, "attention_bias", origin, false, false), origin,
                   ": attention_bias=true is not supported (Mixtral has no attention biases)");
  // sliding_window: Mixtral v0.1 ships null; a window shorter than the context would change attention.
  if (j.contains("sliding_window") && !j["sliding_window"].is_null()) {
    const int window = get_field<int>(j, "sliding_window", origin, false, 0);
    MOEX_CHECK_INPUT(window >= c.max_position_embeddings, origin, ": sliding_window ", window,
                     " < max_position_embeddings is not supported (set it to null)");
  }
  if (j.contains("quantization_config") && !j["quantization_config"].is_null())
    c.quantization = parse_quantization_config(j["quantization_config"].dump(), origin);
  validate_model_config(c);
  return c;
}

ModelConfig load_model_config(const std::string& path) {
  return parse_model_config(read_small_file(path, kMaxJsonFileBytes, "(is --model a Hugging Face model folder?)"),
                            path);
}

std::string model_config_to_json(const ModelConfig& c) {
  json j = {{"architectures", {"MixtralForCausalLM"}},
            {"model_type", c.model_type},
            {"vocab_size", c.vocab_size},
            {"hidden_size", c.hidden_size},
            {"intermediate_size", c.intermediate_size},
            {"num_hidden_layers", c.num_hidden_layers},
            {"num_attention_heads", c.num_attention_heads},
            {"num_key_value_heads", c.num_key_value_heads},
            {"head_dim", c.head_dim},
            {"num_local_experts", c.num_local_experts},
            {"num_experts_per_tok", c.num_experts_per_tok},
            {"rms_norm_eps", c.rms_norm_eps},
            {"rope_theta", c.rope_theta},
            {"max_position_embeddings", c.max_position_embeddings},
            {"tie_word_embeddings", c.tie_word_embeddings},
            {"router_aux_loss_coef", c.router_aux_loss_coef},
            {"bos_token_id", c.bos_token_id},
            {"eos_token_id", c.eos_token_id},
            {"hidden_act", "silu"},
            {"sliding_window", nullptr},
            {"attention_dropout", 0.0},
            {"initializer_range", 0.02},
            {"use_cache", true},
            {"output_router_logits", false},
            {"router_jitter_noise", 0.0},
            {"torch_dtype", c.torch_dtype}};
  if (!c.norm_topk_prob) j["norm_topk_prob"] = false;
  if (c.quantization.quantized()) j["quantization_config"] = json::parse(c.quantization.json);
  return j.dump(2) + "\n";
}

}  // namespace moex
