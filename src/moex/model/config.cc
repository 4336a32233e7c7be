#include "moex/model/config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
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

// Fields every family's HF config may carry that do not change inference, or that are checked below.
const std::set<std::string>& common_fields() {
  static const std::set<std::string> fields = {
      "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "num_experts_per_tok", "rms_norm_eps", "rope_theta",
      "max_position_embeddings", "tie_word_embeddings", "norm_topk_prob", "router_aux_loss_coef", "bos_token_id",
      "eos_token_id", "pad_token_id", "torch_dtype", "hidden_act", "initializer_range", "use_cache",
      "output_router_logits", "attention_dropout", "transformers_version", "rope_scaling", "rope_parameters",
      "_name_or_path",
      "quantization_config"};
  return fields;
}

// The fields of one family's HF config class beyond the common ones (its declaration's config_keys: transformers'
// MixtralConfig, Qwen2MoeConfig, ...). Any other field is unknown: a config from a newer or different
// architecture must not load silently.
bool family_field(const FamilyInfo& f, const std::string& key) { return family_has_config_key(f, key.c_str()); }

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

const FamilyInfo& family_info(ModelFamily family) {
  for (const FamilyInfo& f : kFamilies)
    if (f.family == family) return f;
  throw_error(ErrorKind::kInternal, "config: a model family without a declaration in families.h");
}

ModelFamily family_from_model_type(const std::string& model_type, const std::string& origin) {
  std::string names;
  for (const FamilyInfo& f : kFamilies) {
    if (model_type == f.model_type) return f.family;
    names += (names.empty() ? "" : ", ") + std::string(f.model_type);
  }
  MOEX_CHECK_INPUT(model_type != "deepseek_v2" && model_type != "deepseek_v3" && model_type != "kimi_k2", origin,
                   ": model_type \"", model_type,
                   "\" uses multi-head latent attention (MLA), which MoEX does not run; its router (sigmoid + "
                   "correction bias + grouped top-k) is supported on standard attention as model_type \"dots1\"");
  throw_error(ErrorKind::kInvalidInput,
              origin + ": model_type \"" + model_type + "\" is not supported (MoEX runs " + names + ")");
}

bool ModelConfig::moe_layer(int layer) const {
  if (layer < first_k_dense_replace) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

int64_t ModelConfig::active_params_per_token() const {
  const int64_t d = hidden_size;
  const int64_t attention = d * q_dim() + 2 * d * kv_dim() + q_dim() * d;
  int64_t total = d + int64_t{vocab_size} * d + d;
  for (int l = 0; l < num_hidden_layers; ++l) {
    total += attention + 2 * d;
    if (moe_layer(l)) {
      total += int64_t{num_experts_per_tok} * 3 * d * intermediate_size + int64_t{num_local_experts} * d +
               3 * d * int64_t{shared_expert_intermediate_size} + (shared_expert_gate ? d : 0);
    } else {
      total += 3 * d * int64_t{dense_intermediate_size};
    }
  }
  return total;
}

int64_t ModelConfig::total_params() const {
  const int64_t d = hidden_size;
  const int64_t attention = d * q_dim() + 2 * d * kv_dim() + q_dim() * d;
  int64_t total = d + int64_t{vocab_size} * d * (tie_word_embeddings ? 1 : 2);
  for (int l = 0; l < num_hidden_layers; ++l) {
    total += attention + 2 * d;
    if (moe_layer(l)) {
      total += int64_t{num_local_experts} * (3 * d * intermediate_size + d) +
               3 * d * int64_t{shared_expert_intermediate_size} + (shared_expert_gate ? d : 0);
    } else {
      total += 3 * d * int64_t{dense_intermediate_size};
    }
  }
  return total;
}

void validate_model_config(const ModelConfig& c) {
  MOEX_CHECK_INPUT(c.model_type == c.info().model_type, "config: model_type \"", c.model_type,
                   "\" does not match the family (", c.info().model_type, ")");
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
  MOEX_CHECK_INPUT((!c.has_bos || (c.bos_token_id >= 0 && c.bos_token_id < c.vocab_size)) && c.eos_token_id >= 0 &&
                       c.eos_token_id < c.vocab_size,
                   "config: bos_token_id (", c.bos_token_id, ") and eos_token_id (", c.eos_token_id,
                   ") must be token ids below vocab_size (", c.vocab_size, ")");
  MOEX_CHECK_INPUT(c.pad_token_id >= -1 && c.pad_token_id < c.vocab_size, "config: pad_token_id (", c.pad_token_id,
                   ") must be a token id below vocab_size (", c.vocab_size, ")");
  // Family options.
  MOEX_CHECK_INPUT(c.decoder_sparse_step >= 1, "config: decoder_sparse_step (", c.decoder_sparse_step,
                   ") must be at least 1");
  MOEX_CHECK_INPUT(c.first_k_dense_replace >= 0 && c.first_k_dense_replace <= c.num_hidden_layers,
                   "config: first_k_dense_replace (", c.first_k_dense_replace, ") must be in 0..num_hidden_layers (",
                   c.num_hidden_layers, ")");
  for (int l : c.mlp_only_layers) {
    MOEX_CHECK_INPUT(l >= 0 && l < c.num_hidden_layers, "config: mlp_only_layers holds ", l,
                     ", not a layer index below num_hidden_layers (", c.num_hidden_layers, ")");
  }
  bool any_dense = false;
  for (int l = 0; l < c.num_hidden_layers; ++l) any_dense = any_dense || !c.moe_layer(l);
  MOEX_CHECK_INPUT(!any_dense || c.dense_intermediate_size > 0, "config: intermediate_size (",
                   c.dense_intermediate_size, ") of the dense MLP layers must be positive");
  MOEX_CHECK_INPUT(c.shared_expert_intermediate_size >= 0 && (!c.shared_expert_gate || c.shared_expert_intermediate_size > 0),
                   "config: the shared expert's intermediate size (", c.shared_expert_intermediate_size,
                   ") must be positive");
  if (c.scoring == RouterScoring::kSigmoidGrouped) {
    MOEX_CHECK_INPUT(c.n_group >= 1 && c.num_local_experts % c.n_group == 0, "config: n_group (", c.n_group,
                     ") must divide the number of routed experts (", c.num_local_experts, ")");
    MOEX_CHECK_INPUT(c.n_group == 1 || c.num_local_experts / c.n_group >= 2, "config: n_group (", c.n_group,
                     ") leaves fewer than 2 experts per group (a group scores by its best two)");
    MOEX_CHECK_INPUT(c.topk_group >= 1 && c.topk_group <= c.n_group, "config: topk_group (", c.topk_group,
                     ") must be in 1..n_group (", c.n_group, ")");
    MOEX_CHECK_INPUT(int64_t{c.topk_group} * (c.num_local_experts / c.n_group) >= c.num_experts_per_tok,
                     "config: topk_group (", c.topk_group, ") groups of ", c.num_local_experts / c.n_group,
                     " experts cannot hold num_experts_per_tok (", c.num_experts_per_tok, ") experts");
    MOEX_CHECK_INPUT(std::isfinite(c.routed_scaling_factor) && c.routed_scaling_factor > 0,
                     "config: routed_scaling_factor (", c.routed_scaling_factor, ") must be finite and positive");
  }
  // Widths are ints and products of them index buffers: keep every product the code forms in range.
  const int64_t int_max = std::numeric_limits<int>::max();
  MOEX_CHECK_INPUT(int64_t{c.num_attention_heads} * c.head_dim <= int_max, "config: num_attention_heads x head_dim (",
                   int64_t{c.num_attention_heads} * c.head_dim, ") is out of range");
  const double d = c.hidden_size, q = double(c.num_attention_heads) * c.head_dim,
               kv = double(c.num_key_value_heads) * c.head_dim;
  const double params = c.num_hidden_layers * (2 * d * q + 2 * d * kv + double(c.num_local_experts) *
                                                                            (3 * d * c.intermediate_size + d) +
                                               3 * d * (double(c.shared_expert_intermediate_size) +
                                                        double(c.dense_intermediate_size))) +
                        2.0 * c.vocab_size * d;
  MOEX_CHECK_INPUT(params < 1e15, "config: the sizes give ", params, " parameters, more than any checkpoint MoEX loads");
}

namespace {

// rope_theta, from the old field or from transformers' newer rope_parameters {rope_type, rope_theta}.
float parse_rope(const json& j, const std::string& origin, float fallback) {
  MOEX_CHECK_INPUT(!j.contains("rope_scaling") || j["rope_scaling"].is_null(), origin,
                   ": rope_scaling is not supported; remove it or set it to null");
  float theta = get_field<float>(j, "rope_theta", origin, false, fallback);
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const json& r = j["rope_parameters"];
    MOEX_CHECK_INPUT(r.is_object(), origin, ": rope_parameters must be an object");
    for (const auto& [key, value] : r.items()) {
      MOEX_CHECK_INPUT(key == "rope_type" || key == "rope_theta", origin, ": rope_parameters.", key,
                       " is not supported (MoEX runs the default RoPE)");
    }
    const std::string type = get_field<std::string>(r, "rope_type", origin, false, "default");
    MOEX_CHECK_INPUT(type == "default", origin, ": rope_parameters.rope_type \"", type,
                     "\" is not supported (MoEX runs the default RoPE)");
    theta = get_field<float>(r, "rope_theta", origin, false, theta);
  }
  return theta;
}

// Refuses a config in which some layer would use sliding-window attention: HF's rule per family.
void refuse_sliding_windows(const json& j, const ModelConfig& c, const std::string& origin, bool needs_flag,
                            int max_window_layers_default) {
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const json& types = j["layer_types"];
    MOEX_CHECK_INPUT(types.is_array() && static_cast<int>(types.size()) == c.num_hidden_layers, origin,
                     ": layer_types must list num_hidden_layers (", c.num_hidden_layers, ") entries");
    for (const json& t : types) {
      MOEX_CHECK_INPUT(t.is_string() && t.get<std::string>() == "full_attention", origin, ": layer_types holds ",
                       t.dump(), " (MoEX runs full attention only: sliding windows are not supported)");
    }
    return;
  }
  const bool use = needs_flag ? get_field<bool>(j, "use_sliding_window", origin, false, false) : true;
  if (!use || !j.contains("sliding_window") || j["sliding_window"].is_null()) return;
  const int window = get_field<int>(j, "sliding_window", origin, false, 0);
  const int from_layer = get_field<int>(j, "max_window_layers", origin, false, max_window_layers_default);
  MOEX_CHECK_INPUT(from_layer >= c.num_hidden_layers || window >= c.max_position_embeddings, origin,
                   ": sliding_window ", window, " applies from layer ", from_layer,
                   " (max_window_layers) and is not supported (set use_sliding_window false or sliding_window null)");
}

std::vector<int> parse_int_list(const json& j, const char* name, const std::string& origin) {
  std::vector<int> out;
  if (!j.contains(name) || j[name].is_null()) return out;
  MOEX_CHECK_INPUT(j[name].is_array(), origin, ": field \"", name, "\" must be a list of layer indices");
  for (const json& v : j[name]) {
    const json holder = {{"item", v}};
    out.push_back(get_field<int>(holder, "item", origin + ": " + name, true, 0));
  }
  return out;
}

}  // namespace

ModelConfig parse_model_config(const std::string& text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw_error(ErrorKind::kInvalidInput, origin + ": not valid JSON (" + e.what() + ")");
  }
  MOEX_CHECK_INPUT(j.is_object(), origin, ": expected a JSON object");
  ModelConfig c;
  c.model_type = get_field<std::string>(j, "model_type", origin, true, "");
  c.family = family_from_model_type(c.model_type, origin);
  const FamilyInfo& info = c.info();
  for (const auto& [key, value] : j.items()) {
    MOEX_CHECK_INPUT(common_fields().count(key) || family_field(info, key), origin, ": unknown field \"", key,
                     "\" for model_type \"", c.model_type,
                     "\" (remove the field if it does not change the model)");
  }
  c.qk_norm = info.qk_norm;
  c.scoring = info.scoring;
  // Mixtral keeps MixtralConfig's defaults for the fields it may omit; the other families need the fields
  // their HF config.json always carries (their class defaults differ between transformers versions).
  const bool strict = info.strict;
  c.vocab_size = get_field<int>(j, "vocab_size", origin, true, 0);
  c.hidden_size = get_field<int>(j, "hidden_size", origin, true, 0);
  c.num_hidden_layers = get_field<int>(j, "num_hidden_layers", origin, true, 0);
  c.num_attention_heads = get_field<int>(j, "num_attention_heads", origin, true, 0);
  c.num_key_value_heads = get_field<int>(j, "num_key_value_heads", origin, info.kv_heads_required,
                                         c.num_attention_heads);
  const bool takes_head_dim = family_field(info, "head_dim");
  MOEX_CHECK_INPUT((c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads == 0) ||
                       (takes_head_dim && j.contains("head_dim")),
                   origin, ": hidden_size (", c.hidden_size, ") is not divisible by num_attention_heads (",
                   c.num_attention_heads, ") and no head_dim is given");
  c.head_dim = takes_head_dim ? get_field<int>(j, "head_dim", origin, info.head_dim_required,
                                               c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0)
                              : (c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
  c.num_local_experts = get_field<int>(j, info.experts_key, origin, true, 0);
  c.num_experts_per_tok = get_field<int>(j, "num_experts_per_tok", origin, true, 0);
  // Expert width: intermediate_size in mixtral and olmoe; moe_intermediate_size (and a dense intermediate_size)
  // in the others.
  if (!info.moe_intermediate) {
    c.intermediate_size = get_field<int>(j, "intermediate_size", origin, true, 0);
  } else {
    c.intermediate_size = get_field<int>(j, "moe_intermediate_size", origin, true, 0);
    c.dense_intermediate_size = get_field<int>(j, "intermediate_size", origin, true, 0);
  }
  c.rms_norm_eps = get_field<float>(j, "rms_norm_eps", origin, strict, 1e-5f);
  c.rope_theta = parse_rope(j, origin, 1e6f);
  MOEX_CHECK_INPUT(!strict || j.contains("rope_theta") || j.contains("rope_parameters"), origin,
                   ": missing required field \"rope_theta\"");
  c.max_position_embeddings = get_field<int>(j, "max_position_embeddings", origin, strict, 32768);
  c.tie_word_embeddings = get_field<bool>(j, "tie_word_embeddings", origin, false, false);
  c.norm_topk_prob = get_field<bool>(j, "norm_topk_prob", origin, strict, true);
  c.router_aux_loss_coef = get_field<float>(j, "router_aux_loss_coef", origin, false, 0.02f);
  c.has_bos = !(j.contains("bos_token_id") && j["bos_token_id"].is_null());
  c.bos_token_id = c.has_bos ? get_field<int>(j, "bos_token_id", origin, false, 1) : -1;
  MOEX_CHECK_INPUT(!j.contains("eos_token_id") || !j["eos_token_id"].is_array(), origin,
                   ": eos_token_id lists are not supported (give one id)");
  c.eos_token_id = get_field<int>(j, "eos_token_id", origin, false, 2);
  c.pad_token_id = get_field<int>(j, "pad_token_id", origin, false, -1);
  c.torch_dtype = get_field<std::string>(j, "torch_dtype", origin, false, "bfloat16");
  const std::string act = get_field<std::string>(j, "hidden_act", origin, false, "silu");
  MOEX_CHECK_INPUT(act == "silu", origin, ": hidden_act \"", act, "\" is not supported (these families use silu)");
  // Attention options. o_proj biases (attention_bias=true in every family that has the field) are not run.
  MOEX_CHECK_INPUT(!get_field<bool>(j, "attention_bias", origin, false, false), origin,
                   ": attention_bias=true is not supported (it adds an o_proj bias MoEX does not run)");
  if (info.qkv_bias_key) c.qkv_bias = get_field<bool>(j, "qkv_bias", origin, false, true);
  if (family_field(info, "clip_qkv")) {
    MOEX_CHECK_INPUT(!j.contains("clip_qkv") || j["clip_qkv"].is_null(), origin,
                     ": clip_qkv is not supported (set it to null)");
  }
  // Dense layers and shared experts.
  if (info.dense_layers == DenseLayers::kSparseStep) {
    c.decoder_sparse_step = get_field<int>(j, "decoder_sparse_step", origin, false, 1);
    c.mlp_only_layers = parse_int_list(j, "mlp_only_layers", origin);
  }
  if (info.shared_experts == SharedExperts::kGated) {
    c.shared_expert_intermediate_size = get_field<int>(j, "shared_expert_intermediate_size", origin, true, 0);
    c.shared_expert_gate = true;
  }
  if (info.shared_experts == SharedExperts::kCount) {
    c.n_shared_experts = get_field<int>(j, "n_shared_experts", origin, true, 0);
    MOEX_CHECK_INPUT(c.n_shared_experts >= 1, origin, ": n_shared_experts (", c.n_shared_experts,
                     ") must be at least 1 (Dots1MoE always has shared experts)");
    MOEX_CHECK_INPUT(int64_t{c.n_shared_experts} * c.intermediate_size <= std::numeric_limits<int>::max(), origin,
                     ": n_shared_experts x moe_intermediate_size is out of range");
    c.shared_expert_intermediate_size = c.n_shared_experts * c.intermediate_size;
  }
  if (info.dense_layers == DenseLayers::kFirstK)
    c.first_k_dense_replace = get_field<int>(j, "first_k_dense_replace", origin, true, 0);
  if (info.scoring == RouterScoring::kSigmoidGrouped) {
    c.n_group = get_field<int>(j, "n_group", origin, true, 1);
    c.topk_group = get_field<int>(j, "topk_group", origin, true, 1);
    c.routed_scaling_factor = get_field<float>(j, "routed_scaling_factor", origin, true, 1.0f);
  }
  // Sliding windows: Mixtral v0.1 ships null; a window shorter than the context would change attention.
  if (info.sliding_window == SlidingWindow::kWindow) {
    if (j.contains("sliding_window") && !j["sliding_window"].is_null()) {
      const int window = get_field<int>(j, "sliding_window", origin, false, 0);
      MOEX_CHECK_INPUT(window >= c.max_position_embeddings, origin, ": sliding_window ", window,
                       " < max_position_embeddings is not supported (set it to null)");
    }
  } else if (info.sliding_window != SlidingWindow::kNoField) {
    refuse_sliding_windows(j, c, origin, /*needs_flag=*/info.sliding_window == SlidingWindow::kFlagged,
                           info.max_window_layers_default);
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

// A float field as the double its shortest decimal spells (1e-06, not 9.999999974752427e-07), as HF writes it:
// the fewest digits that still read back as the same float.
static double short_float(float value) {
  char text[32];
  for (int digits = 6; digits <= 9; ++digits) {
    std::snprintf(text, sizeof(text), "%.*g", digits, static_cast<double>(value));
    if (std::strtof(text, nullptr) == value) break;
  }
  return std::strtod(text, nullptr);
}

std::string model_config_to_json(const ModelConfig& c) {
  const FamilyInfo& info = c.info();
  json j = {{"architectures", {info.architecture}},
            {"model_type", c.model_type},
            {"vocab_size", c.vocab_size},
            {"hidden_size", c.hidden_size},
            {"num_hidden_layers", c.num_hidden_layers},
            {"num_attention_heads", c.num_attention_heads},
            {"num_key_value_heads", c.num_key_value_heads},
            {"num_experts_per_tok", c.num_experts_per_tok},
            {"rms_norm_eps", short_float(c.rms_norm_eps)},
            {"rope_theta", short_float(c.rope_theta)},
            {"max_position_embeddings", c.max_position_embeddings},
            {"tie_word_embeddings", c.tie_word_embeddings},
            {"router_aux_loss_coef", short_float(c.router_aux_loss_coef)},
            {"bos_token_id", c.has_bos ? json(c.bos_token_id) : json(nullptr)},
            {"eos_token_id", c.eos_token_id},
            {"hidden_act", "silu"},
            {"attention_dropout", 0.0},
            {"initializer_range", 0.02},
            {"use_cache", true},
            {"output_router_logits", false},
            {"torch_dtype", c.torch_dtype}};
  if (c.pad_token_id >= 0) j["pad_token_id"] = c.pad_token_id;
  // What the family's HF config class writes, from its declaration (families.h).
  if (info.writes_rope_scaling) j["rope_scaling"] = nullptr;
  j[info.experts_key] = c.num_local_experts;
  j["intermediate_size"] = info.moe_intermediate ? c.dense_intermediate_size : c.intermediate_size;
  if (info.moe_intermediate) j["moe_intermediate_size"] = c.intermediate_size;
  if (info.writes_head_dim) j["head_dim"] = c.head_dim;
  if (info.writes_attention_bias) j["attention_bias"] = false;
  if (family_field(info, "sliding_window")) j["sliding_window"] = nullptr;
  if (family_field(info, "max_window_layers")) j["max_window_layers"] = c.num_hidden_layers;
  if (info.strict || !c.norm_topk_prob) j["norm_topk_prob"] = c.norm_topk_prob;  // Mixtral's only when false
  if (family_field(info, "router_jitter_noise")) j["router_jitter_noise"] = 0.0;
  if (family_field(info, "clip_qkv")) j["clip_qkv"] = nullptr;
  if (info.sliding_window == SlidingWindow::kFlagged) j["use_sliding_window"] = false;
  if (info.qkv_bias_key && !c.qkv_bias) j["qkv_bias"] = false;
  if (info.dense_layers == DenseLayers::kSparseStep) {
    j["decoder_sparse_step"] = c.decoder_sparse_step;
    j["mlp_only_layers"] = c.mlp_only_layers;
  }
  if (info.dense_layers == DenseLayers::kFirstK) j["first_k_dense_replace"] = c.first_k_dense_replace;
  if (info.shared_experts == SharedExperts::kGated)
    j["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size;
  if (info.shared_experts == SharedExperts::kCount) j["n_shared_experts"] = c.n_shared_experts;
  if (info.scoring == RouterScoring::kSigmoidGrouped) {
    j["n_group"] = c.n_group;
    j["topk_group"] = c.topk_group;
    j["routed_scaling_factor"] = short_float(c.routed_scaling_factor);
  }
  if (c.quantization.quantized()) j["quantization_config"] = json::parse(c.quantization.json);
  return j.dump(2) + "\n";
}

}  // namespace moex
