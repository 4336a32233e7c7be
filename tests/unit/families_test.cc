// Model families: each family's HF config.json (as the published checkpoints ship it) parses onto the right
// options, what MoEX cannot run is refused with one line, the dense-layer rules, the gen-model presets, and
// the sigmoid grouped router against values worked out by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "moex/base/error.h"
#include "moex/model/config.h"
#include "moex/moe/gating.h"
#include "test_util.h"
#include "tools/lib/synthetic.h"

namespace moex {
namespace {

using test::expect_input_error;
using test::replace;

// The config.json fields of Qwen/Qwen3-30B-A3B (values as published).
const char* kQwen3 = R"({"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
  "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
  "norm_topk_prob": true, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
  "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": false, "rms_norm_eps": 1e-06,
  "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true,
  "use_sliding_window": false, "vocab_size": 151936})";

// Qwen/Qwen1.5-MoE-A2.7B.
const char* kQwen2 = R"({"architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21, "model_type": "qwen2_moe",
  "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.36.0.dev0", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936,
  "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
  "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": false, "output_router_logits": false,
  "router_aux_loss_coef": 0.001})";

// allenai/OLMoE-1B-7B-0924.
const char* kOlmoe = R"({"architectures": ["OlmoeForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "clip_qkv": null, "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 1024, "max_position_embeddings": 4096, "model_type": "olmoe", "norm_topk_prob": false,
  "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
  "num_key_value_heads": 16, "output_router_logits": false, "pad_token_id": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": null, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 50304,
  "bos_token_id": null})";

// Dots1Config's fields with a dots.llm1-like geometry.
const char* kDots1 = R"({"architectures": ["Dots1ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 10944, "max_position_embeddings": 32768, "max_window_layers": 62, "model_type": "dots1",
  "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 2,
  "norm_topk_prob": true, "num_attention_heads": 32, "num_experts_per_tok": 6, "num_hidden_layers": 62,
  "num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-05, "rope_scaling": null, "rope_theta": 10000000,
  "routed_scaling_factor": 2.5, "sliding_window": null, "tie_word_embeddings": false, "topk_group": 1,
  "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 152064, "bos_token_id": 151643,
  "eos_token_id": 151649})";

TEST(Families, Qwen3MoeConfig) {
  const ModelConfig c = parse_model_config(kQwen3, "config.json");
  EXPECT_EQ(c.family, ModelFamily::kQwen3Moe);
  EXPECT_EQ(c.head_dim, 128);  // not hidden / heads (64)
  EXPECT_EQ(c.q_dim(), 4096);
  EXPECT_EQ(c.intermediate_size, 768);  // the expert width
  EXPECT_EQ(c.dense_intermediate_size, 6144);
  EXPECT_EQ(c.num_local_experts, 128);
  EXPECT_EQ(c.qk_norm, QkNorm::kPerHead);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.shared_expert_intermediate_size, 0);
  for (int l = 0; l < c.num_hidden_layers; ++l) EXPECT_TRUE(c.moe_layer(l));
  // 30.5B parameters, 3.3B active (Qwen's published figures; active counts the whole embedding).
  EXPECT_NEAR(c.total_params() / 1e9, 30.5, 0.1);
  EXPECT_NEAR((c.active_params_per_token() + (c.vocab_size - 1.0) * c.hidden_size) / 1e9, 3.3, 0.06);
}

TEST(Families, Qwen2MoeConfig) {
  const ModelConfig c = parse_model_config(kQwen2, "config.json");
  EXPECT_EQ(c.family, ModelFamily::kQwen2Moe);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_TRUE(c.shared_expert_gate);
  EXPECT_EQ(c.shared_expert_intermediate_size, 5632);
  EXPECT_EQ(c.intermediate_size, 1408);
  EXPECT_FALSE(c.norm_topk_prob);
  // 14.3B parameters in all, 2.7B active (Qwen's figures; active counts the whole embedding).
  EXPECT_NEAR(c.total_params() / 1e9, 14.3, 0.1);
  EXPECT_NEAR((c.active_params_per_token() + (c.vocab_size - 1.0) * c.hidden_size) / 1e9, 2.7, 0.05);
  // decoder_sparse_step and mlp_only_layers make dense layers.
  const ModelConfig s = parse_model_config(
      replace(replace(kQwen2, R"("decoder_sparse_step": 1)", R"("decoder_sparse_step": 2)"), R"("num_experts": 60)",
              R"("num_experts": 60, "mlp_only_layers": [3])"),
      "c");
  EXPECT_FALSE(s.moe_layer(0));
  EXPECT_TRUE(s.moe_layer(1));
  EXPECT_FALSE(s.moe_layer(3));
  EXPECT_TRUE(s.moe_layer(5));
}

TEST(Families, OlmoeConfig) {
  const ModelConfig c = parse_model_config(kOlmoe, "config.json");
  EXPECT_EQ(c.family, ModelFamily::kOlmoe);
  EXPECT_EQ(c.qk_norm, QkNorm::kWhole);
  EXPECT_EQ(c.intermediate_size, 1024);  // olmoe's experts are intermediate_size wide
  EXPECT_FALSE(c.has_bos);
  EXPECT_EQ(c.pad_token_id, 1);
  // 6.9B in all, 1.3B active (AI2's figures).
  EXPECT_NEAR(c.total_params() / 1e9, 6.9, 0.05);
  EXPECT_NEAR((c.active_params_per_token() + (c.vocab_size - 1.0) * c.hidden_size) / 1e9, 1.3, 0.05);
}

TEST(Families, Dots1Config) {
  const ModelConfig c = parse_model_config(kDots1, "config.json");
  EXPECT_EQ(c.family, ModelFamily::kDots1);
  EXPECT_EQ(c.scoring, RouterScoring::kSigmoidGrouped);
  EXPECT_EQ(c.shared_expert_intermediate_size, 2 * 1408);
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 2.5f);
  EXPECT_FALSE(c.moe_layer(0));
  EXPECT_TRUE(c.moe_layer(1));
}

TEST(Families, RoundTripThroughJsonAndPresets) {
  for (const char* text : {kQwen3, kQwen2, kOlmoe, kDots1}) {
    const ModelConfig c = parse_model_config(text, "a");
    const ModelConfig back = parse_model_config(model_config_to_json(c), "b");
    EXPECT_EQ(model_config_to_json(back), model_config_to_json(c));
    EXPECT_EQ(back.total_params(), c.total_params());
  }
  for (const std::string& name : synthetic_preset_names()) {
    const ModelConfig c = synthetic_preset(name);
    validate_model_config(c);
    const ModelConfig back = parse_model_config(model_config_to_json(c), name);
    EXPECT_EQ(back.family, c.family) << name;
    EXPECT_EQ(back.total_params(), c.total_params()) << name;
    EXPECT_EQ(model_config_to_json(back), model_config_to_json(c)) << name;
  }
  // The real-geometry presets are those models.
  EXPECT_NEAR(synthetic_preset("qwen3-30b-a3b").total_params() / 1e9, 30.5, 0.1);
  EXPECT_NEAR(synthetic_preset("olmoe-1b-7b").total_params() / 1e9, 6.9, 0.05);
  EXPECT_NEAR(synthetic_preset("qwen2-moe-a2.7b").total_params() / 1e9, 14.3, 0.1);
}

TEST(Families, FuzzSeedsParse) {
  const std::string seeds = std::string(MOEX_SOURCE_DIR) + "/tests/fuzz/seeds/config/";
  EXPECT_EQ(load_model_config(seeds + "qwen2-moe-tiny.json").family, ModelFamily::kQwen2Moe);
  EXPECT_EQ(load_model_config(seeds + "qwen3-moe-tiny.json").family, ModelFamily::kQwen3Moe);
  EXPECT_EQ(load_model_config(seeds + "olmoe-tiny.json").family, ModelFamily::kOlmoe);
  EXPECT_EQ(load_model_config(seeds + "dots1-tiny.json").family, ModelFamily::kDots1);
  // What gen-model writes spells floats as HF does.
  EXPECT_NE(model_config_to_json(synthetic_preset("qwen3-moe-tiny")).find("\"rms_norm_eps\": 1e-06"), std::string::npos);
  // and round-trips floats that need all nine digits.
  ModelConfig c = synthetic_preset("dots1-tiny");
  c.rms_norm_eps = std::nextafter(1e-6f, 1.0f);
  c.routed_scaling_factor = std::nextafter(2.5f, 0.0f);
  const ModelConfig back = parse_model_config(model_config_to_json(c), "c");
  EXPECT_EQ(back.rms_norm_eps, c.rms_norm_eps);
  EXPECT_EQ(back.routed_scaling_factor, c.routed_scaling_factor);
}

TEST(Families, RefusesWhatItCannotRun) {
  const struct {
    std::string json, cause;
  } cases[] = {
      {replace(kQwen3, R"("model_type": "qwen3_moe")", R"("model_type": "deepseek_v3")"), "multi-head latent"},
      {replace(kQwen3, R"("model_type": "qwen3_moe")", R"("model_type": "deepseek_v2")"), "dots1"},
      {replace(kQwen3, R"("model_type": "qwen3_moe")", R"("model_type": "llama")"), "not supported"},
      {replace(kQwen3, R"("attention_bias": false)", R"("attention_bias": true)"), "attention_bias"},
      // A window applies from layer max_window_layers on (HF's layer_types rule); 48 of 48 layers means none.
      {replace(replace(replace(kQwen3, R"("use_sliding_window": false)", R"("use_sliding_window": true)"),
                       R"("sliding_window": null)", R"("sliding_window": 4096)"),
               R"("max_window_layers": 48)", R"("max_window_layers": 40)"),
       "sliding_window"},
      {replace(kQwen3, R"("mlp_only_layers": [])", R"("mlp_only_layers": [48])"), "mlp_only_layers"},
      {replace(kQwen3, R"("mlp_only_layers": [])", R"("mlp_only_layers": [1.5])"), "integer"},
      {replace(kQwen3, R"("decoder_sparse_step": 1)", R"("decoder_sparse_step": 0)"), "decoder_sparse_step"},
      {replace(kQwen3, R"("head_dim": 128, )", ""), "head_dim"},
      {replace(kQwen3, R"("moe_intermediate_size": 768,)", ""), "moe_intermediate_size"},
      {replace(kQwen3, R"("rope_scaling": null)", R"("rope_scaling": {"type": "yarn", "factor": 4.0})"), "rope_scaling"},
      {replace(kQwen3, R"("use_cache": true)", R"("use_cache": true, "layer_types": ["sliding_attention"])"),
       "layer_types"},
      {replace(kQwen3, R"("eos_token_id": 151645)", R"("eos_token_id": [151645, 151643])"), "eos_token_id"},
      // A field of another family is unknown here.
      {replace(kQwen3, R"("use_cache": true)", R"("use_cache": true, "n_group": 8)"), "unknown field \"n_group\""},
      {replace(kQwen2, R"("use_cache": true)", R"("use_cache": true, "head_dim": 128)"), "unknown field \"head_dim\""},
      {replace(kQwen2, R"("shared_expert_intermediate_size": 5632,)", ""), "shared_expert_intermediate_size"},
      {replace(kOlmoe, R"("clip_qkv": null)", R"("clip_qkv": 8.0)"), "clip_qkv"},
      {replace(kOlmoe, R"("use_cache": true)", R"("use_cache": true, "moe_intermediate_size": 512)"), "unknown field"},
      {replace(kDots1, R"("n_group": 1)", R"("n_group": 3)"), "n_group"},
      {replace(kDots1, R"("topk_group": 1)", R"("topk_group": 2)"), "topk_group"},
      {replace(kDots1, R"("n_shared_experts": 2)", R"("n_shared_experts": 0)"), "n_shared_experts"},
      {replace(kDots1, R"("routed_scaling_factor": 2.5)", R"("routed_scaling_factor": -1)"), "routed_scaling_factor"},
      {replace(kDots1, R"("first_k_dense_replace": 1)", R"("first_k_dense_replace": 63)"), "first_k_dense_replace"},
      {replace(replace(kDots1, R"("sliding_window": null)", R"("sliding_window": 4096)"), R"("max_window_layers": 62)",
               R"("max_window_layers": 10)"),
       "sliding_window"},
      {replace(kDots1, R"("rope_theta": 10000000)", R"("rope_parameters": {"rope_type": "yarn", "factor": 2})"),
       "rope_parameters"},
  };
  for (const auto& c : cases) expect_input_error([&] { parse_model_config(c.json, "config.json"); }, c.cause);
  // rope_parameters with the default RoPE is the newer spelling of rope_theta.
  EXPECT_FLOAT_EQ(parse_model_config(replace(kDots1, R"("rope_theta": 10000000)",
                                             R"("rope_parameters": {"rope_type": "default", "rope_theta": 5e6})"),
                                     "c")
                      .rope_theta,
                  5e6f);
}

// The sigmoid grouped router on one token, worked by hand. 8 experts in 4 groups of 2, keep 2 groups, top-3.
TEST(Families, SigmoidGroupedRouterByHand) {
  // Logits chosen so that sigmoid gives round-ish scores; bias moves expert 7 up and expert 0 down.
  const float logits[8] = {2.0f, -1.0f, 0.5f, 0.4f, -2.0f, -2.5f, 0.0f, 0.1f};
  const float bias[8] = {-1.0f, 0, 0, 0, 0, 0, 0, 0.6f};
  float s[8];  // the sigmoid scores; the corrected c = s + bias only chooses
  for (int e = 0; e < 8; ++e) s[e] = 1.0f / (1.0f + std::exp(-logits[e]));
  // Group scores (sum of the two corrected scores): g0 = c0 + c1, g1 = c2 + c3, g2 = c4 + c5, g3 = c6 + c7.
  // c0 = 0.881 - 1 = -0.119, c1 = 0.269: g0 = 0.150; g1 = 0.622 + 0.599 = 1.221; g2 = 0.119 + 0.076 = 0.195;
  // g3 = 0.5 + 0.525 + 0.6 = 1.625. Groups 3 and 1 stay; the rest are set to 0. Top-3 of the corrected:
  // c7 = 1.125, c2 = 0.622, c3 = 0.599.
  RouterSpec spec{true, 4, 2, 2.5f};
  int32_t ids[3];
  float weights[3], scratch[16];
  gating::route_sigmoid_grouped(logits, bias, 8, 3, /*norm_topk_prob=*/true, spec, ids, weights, scratch);
  EXPECT_EQ(ids[0], 7);
  EXPECT_EQ(ids[1], 2);
  EXPECT_EQ(ids[2], 3);
  const float sum = s[7] + s[2] + s[3];
  EXPECT_FLOAT_EQ(weights[0], s[7] / sum * 2.5f);  // the uncorrected score, renormalised, scaled
  EXPECT_FLOAT_EQ(weights[1], s[2] / sum * 2.5f);
  EXPECT_FLOAT_EQ(weights[2], s[3] / sum * 2.5f);
  // Without norm_topk_prob: the scores times the scaling. With one group: expert 0's high logit loses to its
  // bias, and the masked-to-zero rule does not apply.
  gating::route_sigmoid_grouped(logits, bias, 8, 3, false, RouterSpec{true, 1, 1, 1.0f}, ids, weights, scratch);
  EXPECT_EQ(ids[0], 7);
  EXPECT_EQ(ids[1], 2);
  EXPECT_EQ(ids[2], 3);
  EXPECT_FLOAT_EQ(weights[0], s[7]);
  // Masked experts score 0 (HF's masked_fill(0.0)), so with negative corrected scores in the kept groups a
  // masked expert can be chosen: all biases -2, keep 1 group (group 1, experts 2 and 3, at about -1.4): the
  // top-3 are masked experts at 0.0, lowest index first.
  const float low[8] = {-2, -2, -2, -2, -2, -2, -2, -2};
  gating::route_sigmoid_grouped(logits, low, 8, 3, false, RouterSpec{true, 4, 1, 1.0f}, ids, weights, scratch);
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(ids[1], 1);
  EXPECT_EQ(ids[2], 4);
  EXPECT_FLOAT_EQ(weights[0], s[0]);  // the weight is still the sigmoid score
  // Every fusion mode gives the same routing for the sigmoid router (it has one path).
  const float x[4] = {1.0f, -0.5f, 0.25f, 2.0f};
  std::vector<float> gate(8 * 4);
  for (size_t i = 0; i < gate.size(); ++i) gate[i] = std::sin(0.7f * static_cast<float>(i));
  TensorView w_gate{gate.data(), DType::kF32, {8, 4}};
  TensorView b{const_cast<float*>(bias), DType::kF32, {8}};
  int32_t ref_ids[3];
  float ref_w[3];
  GatingTopK(8, 3, RouterFusion::kNone, true, spec).route(x, 1, w_gate, ref_ids, ref_w, b);
  for (RouterFusion f : {RouterFusion::kTopkSoftmax, RouterFusion::kFull}) {
    GatingTopK(8, 3, f, true, spec).route(x, 1, w_gate, ids, weights, b);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(ids[i], ref_ids[i]);
      EXPECT_EQ(weights[i], ref_w[i]);
    }
  }
}

}  // namespace
}  // namespace moex
