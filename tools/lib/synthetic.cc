#include "tools/lib/synthetic.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/base/threads.h"

namespace moex {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t mix64(uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// Element `index` of the stream `key`: the index-th output of splitmix64 seeded with `key`, turned into
// the sum of four 16-bit uniforms (Irwin-Hall), centred and scaled to unit variance. One hash per value
// and no transcendental functions: ~1 ns per element.
inline float unit_normal(uint64_t key, uint64_t index) {
  const uint64_t h = mix64(key + (index + 1) * kGolden);
  const int64_t sum = static_cast<int64_t>((h & 0xffff) + ((h >> 16) & 0xffff) + ((h >> 32) & 0xffff) + (h >> 48));
  constexpr float kScale = 1.7320508f / 65536.0f;  // sqrt(12 / 4) / 2^16
  return static_cast<float>(sum - 131070) * kScale;
}

inline float round_to(DType dtype, float v) { return dtype == DType::kBF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

}  // namespace

const std::vector<std::string>& synthetic_preset_names() {
  // Per family a small preset (tests) and one with a real model's geometry (its HF config.json figures).
  static const std::vector<std::string> names = {"tiny",           "small",         "mini",          "mixtral-8x7b",
                                                 "qwen2-moe-tiny", "qwen2-moe-a2.7b", "qwen3-moe-tiny", "qwen3-moe-mini", "qwen3-30b-a3b",
                                                 "olmoe-tiny",     "olmoe-1b-7b",   "dots1-tiny",    "dots-llm1"};
  return names;
}

ModelConfig synthetic_preset(const std::string& name) {
  ModelConfig c;  // defaults are Mixtral-8x7B's
  c.rope_theta = 1e6f;
  c.rms_norm_eps = 1e-5f;
  c.num_local_experts = 8;
  c.num_experts_per_tok = 2;
  auto set = [&](int hidden, int intermediate, int layers, int heads, int kv_heads, int vocab, int max_pos) {
    c.hidden_size = hidden;
    c.intermediate_size = intermediate;
    c.num_hidden_layers = layers;
    c.num_attention_heads = heads;
    c.num_key_value_heads = kv_heads;
    c.head_dim = hidden / heads;
    c.vocab_size = vocab;
    c.max_position_embeddings = max_pos;
  };
  // The families other than Mixtral: sizes, then what the family's config sets.
  auto family = [&](ModelFamily f, int experts, int top_k, int dense_intermediate, bool norm_topk, float theta,
                    float eps) {
    c.family = f;
    c.model_type = family_info(f).model_type;
    c.qk_norm = family_info(f).qk_norm;
    c.scoring = family_info(f).scoring;
    c.num_local_experts = experts;
    c.num_experts_per_tok = top_k;
    c.dense_intermediate_size = dense_intermediate;
    c.norm_topk_prob = norm_topk;
    c.rope_theta = theta;
    c.rms_norm_eps = eps;
    c.router_aux_loss_coef = 0.001f;
    c.qkv_bias = family_info(f).qkv_bias_key;  // the key's default: true
  };
  auto qwen_ids = [&] { c.bos_token_id = 151643, c.eos_token_id = 151645; };
  if (name == "qwen2-moe-tiny") {  // a dense layer (mlp_only_layers) between MoE layers, a gated shared expert
    set(64, 32, 3, 4, 2, 512, 4096);
    family(ModelFamily::kQwen2Moe, 8, 2, 96, false, 1e6f, 1e-6f);
    c.shared_expert_intermediate_size = 80;
    c.shared_expert_gate = true;
    c.mlp_only_layers = {1};
  } else if (name == "qwen2-moe-a2.7b") {  // Qwen1.5-MoE-A2.7B
    set(2048, 1408, 24, 16, 16, 151936, 8192);
    family(ModelFamily::kQwen2Moe, 60, 4, 5632, false, 1e6f, 1e-6f);
    c.shared_expert_intermediate_size = 5632;
    c.shared_expert_gate = true;
    qwen_ids();
  } else if (name == "qwen3-moe-tiny") {  // many experts top-8, per-head q/k norm, head_dim != hidden / heads
    set(64, 32, 2, 4, 2, 512, 4096);
    family(ModelFamily::kQwen3Moe, 32, 8, 128, true, 1e6f, 1e-6f);
    c.head_dim = 32;
  } else if (name == "qwen3-moe-mini") {  // mini's size with Qwen3-MoE's expert shape: 128 small experts top-8
    set(1024, 384, 8, 16, 4, 32000, 32768);
    family(ModelFamily::kQwen3Moe, 128, 8, 3072, true, 1e6f, 1e-6f);
    c.head_dim = 64;
  } else if (name == "qwen3-30b-a3b") {  // Qwen3-30B-A3B
    set(2048, 768, 48, 32, 4, 151936, 40960);
    family(ModelFamily::kQwen3Moe, 128, 8, 6144, true, 1e6f, 1e-6f);
    c.head_dim = 128;
    qwen_ids();
  } else if (name == "olmoe-tiny") {  // q/k norm over the whole projection, softmax over all experts
    set(64, 48, 2, 4, 2, 512, 4096);
    family(ModelFamily::kOlmoe, 16, 4, 0, false, 1e4f, 1e-5f);
    c.router_aux_loss_coef = 0.01f;
  } else if (name == "olmoe-1b-7b") {  // OLMoE-1B-7B-0924
    set(2048, 1024, 16, 16, 16, 50304, 4096);
    family(ModelFamily::kOlmoe, 64, 8, 0, false, 1e4f, 1e-5f);
    c.router_aux_loss_coef = 0.01f;
    c.has_bos = false, c.bos_token_id = -1, c.eos_token_id = 50279, c.pad_token_id = 1;
  } else if (name == "dots1-tiny") {  // sigmoid router with 4 groups (2 kept), shared experts, a dense layer 0
    set(64, 32, 3, 4, 2, 512, 4096);
    family(ModelFamily::kDots1, 16, 4, 128, true, 1e4f, 1e-6f);
    c.n_shared_experts = 2;
    c.shared_expert_intermediate_size = 2 * 32;
    c.first_k_dense_replace = 1;
    c.n_group = 4, c.topk_group = 2;
    c.routed_scaling_factor = 2.5f;
  } else if (name == "dots-llm1") {  // rednote-hilab dots.llm1
    set(4096, 1408, 62, 32, 32, 152064, 32768);
    family(ModelFamily::kDots1, 128, 6, 10944, true, 1e7f, 1e-5f);
    c.head_dim = 128;
    c.n_shared_experts = 2;
    c.shared_expert_intermediate_size = 2 * 1408;
    c.first_k_dense_replace = 1;
    c.routed_scaling_factor = 2.5f;
    c.bos_token_id = 151643, c.eos_token_id = 151649;
  } else if (name == "tiny") {
    set(64, 128, 2, 4, 2, 512, 4096);
  } else if (name == "small") {
    set(256, 512, 4, 8, 2, 512, 4096);
  } else if (name == "mini") {
    set(1024, 3584, 8, 16, 4, 32000, 32768);
  } else if (name == "mixtral-8x7b") {
    set(4096, 14336, 32, 32, 8, 32000, 32768);
  } else {
    std::string list;
    for (const auto& n : synthetic_preset_names()) list += (list.empty() ? "" : ", ") + n;
    throw_error(ErrorKind::kInvalidInput, "--preset: unknown preset '" + name + "' (choose one of " + list + ")");
  }
  return c;
}

SyntheticModel::SyntheticModel(const ModelConfig& config, uint64_t seed, float router_skew, DType dtype)
    : config_(config), seed_key_(mix64(seed ^ 0x6d6f65782d67656eull)), dtype_(dtype) {
  MOEX_CHECK_INPUT(dtype == DType::kBF16 || dtype == DType::kF32, "--dtype: gen-model writes bf16 or f32");
  MOEX_CHECK_INPUT(std::isfinite(router_skew) && router_skew >= 0 && router_skew <= kMaxRouterSkew, "--router-skew: ",
                   router_skew, " must be in [0, ", kMaxRouterSkew, "] (0 = balanced; 1.2 = Zipf exponent 1.2)");
  validate_model_config(config_);
  const int64_t d = config.hidden_size, inter = config.intermediate_size, vocab = config.vocab_size;
  const int64_t q_dim = config.q_dim(), kv_dim = config.kv_dim();
  const float residual_scale = 1.0f / std::sqrt(2.0f * config.num_hidden_layers);
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
  // The bias channel holds half of every hidden state's energy, so the other coordinates of x̂ have rms
  // 1/sqrt(2); matrices that read x̂ get sqrt(2) more so their outputs have unit variance.
  const float input_scale = std::sqrt(2.0f) * inv_sqrt_d;
  // State-dict order of the family's HF model (decides which shard a tensor lands in).
  const FamilyInfo& info = config.info();
  const auto mlp = [&](const std::string& q, int64_t width, const char* gate, const char* up, const char* down) {
    add(q + gate + ".weight", {width, d}, Init::kProjection, input_scale, 0.0f);
    add(q + up + ".weight", {width, d}, Init::kProjection, input_scale, 0.0f);
    add(q + down + ".weight", {d, width}, Init::kResidualOut, residual_scale / std::sqrt(static_cast<float>(width)), 0.0f);
  };
  add("model.embed_tokens.weight", {vocab, d}, Init::kEmbedding, 1.0f, 0.0f);
  for (int layer = 0; layer < config.num_hidden_layers; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    add(p + "self_attn.q_proj.weight", {q_dim, d}, Init::kProjection, input_scale, 0.0f);
    if (config.qkv_bias) add(p + "self_attn.q_proj.bias", {q_dim}, Init::kBias, 0.1f, 0.0f);
    add(p + "self_attn.k_proj.weight", {kv_dim, d}, Init::kProjection, input_scale, 0.0f);
    if (config.qkv_bias) add(p + "self_attn.k_proj.bias", {kv_dim}, Init::kBias, 0.1f, 0.0f);
    add(p + "self_attn.v_proj.weight", {kv_dim, d}, Init::kProjection, input_scale, 0.0f);
    if (config.qkv_bias) add(p + "self_attn.v_proj.bias", {kv_dim}, Init::kBias, 0.1f, 0.0f);
    add(p + "self_attn.o_proj.weight", {d, q_dim}, Init::kResidualOut,
        residual_scale / std::sqrt(static_cast<float>(q_dim)), 0.0f);
    if (config.qk_norm != QkNorm::kNone) {
      const bool per_head = config.qk_norm == QkNorm::kPerHead;
      add(p + "self_attn.q_norm.weight", {per_head ? config.head_dim : q_dim}, Init::kNorm, 0.05f, 1.0f);
      add(p + "self_attn.k_norm.weight", {per_head ? config.head_dim : kv_dim}, Init::kNorm, 0.05f, 1.0f);
    }
    const std::string moe = p + info.moe_prefix + ".";
    const auto experts = [&] {
      for (int e = 0; e < config.num_local_experts; ++e)
        mlp(moe + "experts." + std::to_string(e) + ".", inter, info.expert_gate, info.expert_up, info.expert_down);
    };
    if (!config.moe_layer(layer)) {
      mlp(p + "mlp.", config.dense_intermediate_size, "gate_proj", "up_proj", "down_proj");
    } else if (info.experts_before_gate) {  // Dots1MoE registers experts, gate, shared_experts
      experts();
      add(moe + "gate.weight", {config.num_local_experts, d}, Init::kGate, input_scale, 0.0f);
      add(moe + "gate.e_score_correction_bias", {config.num_local_experts}, Init::kBias, 0.1f, 0.0f);
      mlp(moe + info.shared_prefix + ".", config.shared_expert_intermediate_size, "gate_proj", "up_proj", "down_proj");
    } else {
      add(moe + "gate.weight", {config.num_local_experts, d}, Init::kGate, input_scale, 0.0f);
      experts();
      if (config.shared_expert_intermediate_size > 0)
        mlp(moe + info.shared_prefix + ".", config.shared_expert_intermediate_size, "gate_proj", "up_proj", "down_proj");
      if (config.shared_expert_gate) add(moe + "shared_expert_gate.weight", {1, d}, Init::kProjection, input_scale, 0.0f);
    }
    add(p + "input_layernorm.weight", {d}, Init::kNorm, 0.05f, 1.0f);
    add(p + "post_attention_layernorm.weight", {d}, Init::kNorm, 0.05f, 1.0f);
  }
  add("model.norm.weight", {d}, Init::kNorm, 0.05f, 1.0f);
  add("lm_head.weight", {vocab, d}, Init::kLmHead, 2.0f * input_scale, 0.0f);
  gate_offset_.assign(config.num_local_experts, 0.0f);
  calibrate_router_skew(router_skew);
}

void SyntheticModel::add(const std::string& name, std::vector<int64_t> shape, Init init, float scale, float offset) {
  TensorToWrite t{name, dtype_, std::move(shape)};
  rules_.push_back(Rule{init, mix64(seed_key_ ^ fnv1a64(name)), t.shape.back(), scale, offset});
  tensors_.push_back(std::move(t));
}

inline float SyntheticModel::raw_value(const Rule& rule, int64_t row, int64_t col, int64_t index) const {
  switch (rule.init) {
    case Init::kEmbedding:
      if (col == kBiasChannel) return std::sqrt(static_cast<float>(config_.hidden_size));
      break;
    case Init::kNorm:
      if (col == kBiasChannel) return 1.0f;
      break;
    case Init::kResidualOut:
      if (row == kBiasChannel) return 0.0f;
      break;
    case Init::kGate:
      if (col == kBiasChannel) return gate_offset_[row];
      break;
    case Init::kBias:
      break;
    case Init::kProjection:
    case Init::kLmHead:
      if (col == kBiasChannel) return 0.0f;  // only the router reads the bias channel
      break;
  }
  return rule.offset + rule.scale * unit_normal(rule.key, static_cast<uint64_t>(index));
}

float SyntheticModel::value(size_t tensor, int64_t index) const {
  const Rule& rule = rules_[tensor];
  return round_to(dtype_, raw_value(rule, index / rule.cols, index % rule.cols, index));
}

void SyntheticModel::fill(size_t tensor, int64_t first, int64_t count, uint8_t* out) const {
  const Rule& rule = rules_[tensor];
  parallel_for(count, 1 << 16, [&](int64_t begin, int64_t end) {
    int64_t index = first + begin, row = index / rule.cols, col = index % rule.cols;
    if (dtype_ == DType::kBF16) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(out);
      for (int64_t i = begin; i < end; ++i, ++index) {
        dst[i] = f32_to_bf16(raw_value(rule, row, col, index));
        if (++col == rule.cols) col = 0, ++row;
      }
    } else {
      for (int64_t i = begin; i < end; ++i, ++index) {
        const float v = raw_value(rule, row, col, index);
        std::memcpy(out + 4 * i, &v, 4);  // x86 is little-endian, as safetensors is
        if (++col == rule.cols) col = 0, ++row;
      }
    }
  });
}

std::string SyntheticModel::checkpoint_id() const {
  uint64_t h = mix64(seed_key_ ^ static_cast<uint64_t>(dtype_));
  uint32_t skew_bits = 0;
  std::memcpy(&skew_bits, &skew_.skew, 4);
  h = mix64(h ^ skew_bits);
  for (const TensorToWrite& t : tensors_) {
    h = mix64(h ^ fnv1a64(t.name));
    for (int64_t d : t.shape) h = mix64(h ^ static_cast<uint64_t>(d));
  }
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(h));
  return text;
}

TensorFill SyntheticModel::filler() const {
  return [this](size_t tensor, uint64_t byte_begin, uint8_t* out, uint64_t out_size) {
    const uint64_t element = dtype_size(dtype_);
    fill(tensor, static_cast<int64_t>(byte_begin / element), static_cast<int64_t>(out_size / element), out);
  };
}

// Router skew: gate logit of expert e = noise_e(x̂) + gate[e][c] * x̂[c], with x̂[c] ~ sqrt(d/2) for every
// token. We pick the E offsets so that top-k routing of sampled tokens gives expert e (rank r = e + 1) a
// share of the assignments proportional to 1/r^S, by fixed-point iteration on the measured shares
// (offset_e += 0.5 * log(target_e / measured_e)), then round the offsets as stored and measure again.
std::vector<double> route_shares(const std::vector<float>& noise, const std::vector<float>& channel,
                                 const std::vector<float>& gate_offset, int top_k) {
  const int experts = static_cast<int>(gate_offset.size());
  const int tokens = static_cast<int>(channel.size());
  std::vector<double> share(experts, 0.0);
  std::vector<float> logits(experts);
  std::vector<char> taken(experts);
  for (int t = 0; t < tokens; ++t) {
    for (int e = 0; e < experts; ++e) logits[e] = noise[t * experts + e] + gate_offset[e] * channel[t];
    std::fill(taken.begin(), taken.end(), 0);
    for (int k = 0; k < top_k; ++k) {
      int best = -1;
      for (int e = 0; e < experts; ++e) {
        if (!taken[e] && (best < 0 || logits[e] > logits[best])) best = e;
      }
      taken[best] = 1;
      share[best] += 1.0 / (static_cast<double>(tokens) * top_k);
    }
  }
  return share;
}

ZipfRouterCalibration calibrate_zipf_router(float skew, int top_k, const std::vector<float>& noise,
                                            const std::vector<float>& channel) {
  const int tokens = static_cast<int>(channel.size());
  const int experts = static_cast<int>(noise.size() / channel.size());
  double mean_channel = 0;
  for (float c : channel) mean_channel += c / tokens;

  // Zipf target, water-filled under a cap of 0.95/k: top-k picks k distinct experts per token, so no
  // expert can hold more than 1/k of the assignments; the 5% margin keeps routing from degenerating.
  const double cap = 0.95 / top_k;
  ZipfRouterCalibration out;
  std::vector<double>& target = out.target_share;
  target.assign(experts, 1.0 / experts);
  out.gate_offset.assign(experts, 0.0f);
  const bool feasible = skew > 0 && cap * experts > 1.0;
  if (!feasible) return out;
  std::vector<char> capped(experts, 0);
  for (bool changed = true; changed;) {
    changed = false;
    double free_mass = 1.0, weight_sum = 0;
    for (int e = 0; e < experts; ++e) {
      if (capped[e]) free_mass -= cap;
      else weight_sum += std::pow(e + 1.0, -skew);
    }
    for (int e = 0; e < experts; ++e) {
      target[e] = capped[e] ? cap : free_mass * std::pow(e + 1.0, -skew) / weight_sum;
      if (!capped[e] && target[e] > cap) capped[e] = 1, changed = true;
    }
  }
  std::vector<float> offset(experts);  // in logit units
  for (int e = 0; e < experts; ++e) offset[e] = static_cast<float>(std::log(target[e] / target[0]));
  std::vector<float> column(experts);
  const double floor_share = 0.5 / (static_cast<double>(tokens) * top_k);
  for (int iteration = 0; iteration < 400; ++iteration) {
    for (int e = 0; e < experts; ++e) column[e] = static_cast<float>(offset[e] / mean_channel);
    const std::vector<double> share = route_shares(noise, channel, column, top_k);
    const float step = iteration < 200 ? 0.5f : 0.2f;
    double mean_offset = 0;
    for (int e = 0; e < experts; ++e) {
      offset[e] += step * static_cast<float>(std::log(target[e] / std::max(share[e], floor_share)));
      offset[e] = std::clamp(offset[e], -30.0f, 30.0f);
      mean_offset += offset[e] / experts;
    }
    for (int e = 0; e < experts; ++e) offset[e] -= static_cast<float>(mean_offset);  // top-k ignores shifts
  }
  for (int e = 0; e < experts; ++e) out.gate_offset[e] = static_cast<float>(offset[e] / mean_channel);
  return out;
}

void SyntheticModel::calibrate_router_skew(float skew) {
  const int experts = config_.num_local_experts, top_k = config_.num_experts_per_tok;
  const int64_t d = config_.hidden_size, vocab = config_.vocab_size;
  const int tokens = static_cast<int>(std::min<int64_t>(vocab, 4096));
  size_t embed = 0, gate = 0, norm = 0;
  int first_moe = 0;  // calibrated on the first MoE layer (the same offsets go into every layer's gate)
  while (first_moe + 1 < config_.num_hidden_layers && !config_.moe_layer(first_moe)) ++first_moe;
  const std::string p = "model.layers." + std::to_string(first_moe) + ".";
  for (size_t t = 0; t < tensors_.size(); ++t) {
    if (tensors_[t].name == "model.embed_tokens.weight") embed = t;
    if (tensors_[t].name == p + config_.info().moe_prefix + ".gate.weight") gate = t;
    if (tensors_[t].name == p + "post_attention_layernorm.weight") norm = t;
  }
  // x̂ = rmsnorm(embed[id]) * post_attention_layernorm, as the layer-0 router would see a bare embedding.
  std::vector<float> norm_weight(d), gate_rows(static_cast<size_t>(experts) * d);
  for (int64_t j = 0; j < d; ++j) norm_weight[j] = value(norm, j);
  for (int64_t i = 0; i < experts * d; ++i) gate_rows[i] = value(gate, i);
  std::vector<float> noise(static_cast<size_t>(tokens) * experts), channel(tokens);
  const uint64_t sample_key = mix64(seed_key_ ^ 0x726f757465720000ull);
  parallel_for(tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> x(d);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t id = tokens == vocab ? t : static_cast<int64_t>(mix64(sample_key + t * kGolden) % vocab);
      double sum_sq = 0;
      for (int64_t j = 0; j < d; ++j) {
        x[j] = value(embed, id * d + j);
        sum_sq += static_cast<double>(x[j]) * x[j];
      }
      const float inv_rms = 1.0f / std::sqrt(static_cast<float>(sum_sq / d) + config_.rms_norm_eps);
      for (int64_t j = 0; j < d; ++j) x[j] = x[j] * inv_rms * norm_weight[j];
      channel[t] = x[kBiasChannel];
      for (int e = 0; e < experts; ++e) {
        float logit = 0;
        for (int64_t j = 0; j < d; ++j) {
          if (j != kBiasChannel) logit += gate_rows[e * d + j] * x[j];
        }
        noise[t * experts + e] = logit;
      }
    }
  });
  skew_.skew = skew;
  skew_.tokens = tokens;
  const ZipfRouterCalibration calibration = calibrate_zipf_router(skew, top_k, noise, channel);
  gate_offset_ = calibration.gate_offset;
  skew_.target_share = calibration.target_share;
  for (int e = 0; e < experts; ++e) {
    MOEX_CHECK(std::isfinite(gate_offset_[e]), "router skew ", skew, " calibrated expert ", e, " to a non-finite gate");
  }
  // Measure what is stored: the offsets rounded to the file dtype, like every other gate weight.
  skew_.gate_offset.resize(experts);
  for (int e = 0; e < experts; ++e) skew_.gate_offset[e] = round_to(dtype_, gate_offset_[e]);
  skew_.measured_share = route_shares(noise, channel, skew_.gate_offset, top_k);
  const auto [lo, hi] = std::minmax_element(skew_.measured_share.begin(), skew_.measured_share.end());
  skew_.max_over_mean = *hi * experts;
  skew_.min_over_mean = *lo * experts;
}

std::vector<std::vector<int>> synthetic_prompts(int batch, int length, int vocab_size) {
  std::vector<std::vector<int>> prompts(batch);
  for (int s = 0; s < batch; ++s)
    for (int i = 0; i < length; ++i)
      prompts[s].push_back(static_cast<int>((1 + int64_t{7919} * (i + int64_t{31} * s)) % vocab_size));
  return prompts;
}

std::string generation_config_json(const ModelConfig& config) {
  const nlohmann::json j = {{"_from_model_config", true},
                            {"bos_token_id", config.bos_token_id},
                            {"eos_token_id", config.eos_token_id},
                            {"transformers_version", "4.36.0"}};
  return j.dump(2) + "\n";
}

}  // namespace moex
