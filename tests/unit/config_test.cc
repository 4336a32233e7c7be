#include <gtest/gtest.h>

#include "moex/base/error.h"
#include "moex/model/config.h"

namespace moex {
namespace {

const char* kMixtral = R"({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
  "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
  "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": false, "sliding_window": null,
  "hidden_act": "silu", "torch_dtype": "bfloat16", "router_aux_loss_coef": 0.02, "output_router_logits": false,
  "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": true,
  "transformers_version": "4.36.0", "router_jitter_noise": 0.0})";

TEST(Config, ParsesMixtral8x7B) {
  const ModelConfig c = parse_model_config(kMixtral, "config.json");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_FLOAT_EQ(c.rope_theta, 1e6f);
  EXPECT_TRUE(c.norm_topk_prob);
  // 46.7B parameters in all, 12.9B active per token: the published Mixtral figures. The published
  // "active" count includes the whole embedding table; a decoded token reads only its own row.
  EXPECT_NEAR(c.total_params() / 1e9, 46.7, 0.05);
  const double embedding_rows_not_read = (c.vocab_size - 1.0) * c.hidden_size;
  EXPECT_NEAR((c.active_params_per_token() + embedding_rows_not_read) / 1e9, 12.9, 0.05);
}

TEST(Config, RoundTripsThroughJson) {
  ModelConfig c = parse_model_config(kMixtral, "a");
  c.norm_topk_prob = false;
  const ModelConfig back = parse_model_config(model_config_to_json(c), "b");
  EXPECT_EQ(back.hidden_size, c.hidden_size);
  EXPECT_EQ(back.norm_topk_prob, false);
  EXPECT_EQ(back.num_experts_per_tok, c.num_experts_per_tok);
}

std::string replace(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return text.replace(at, from.size(), to);
}

TEST(Config, RejectsWhatItCannotRunWithOneLine) {
  const struct {
    std::string json, cause;
  } cases[] = {
      {replace(kMixtral, R"("model_type": "mixtral")", R"("model_type": "llama")"), "model_type"},
      {replace(kMixtral, R"("hidden_size": 4096)", R"("hidden_size": 4095)"), "not divisible"},
      {replace(kMixtral, R"("num_key_value_heads": 8)", R"("num_key_value_heads": 5)"), "num_key_value_heads"},
      {replace(kMixtral, R"("num_experts_per_tok": 2)", R"("num_experts_per_tok": 9)"), "num_experts_per_tok"},
      {replace(kMixtral, R"("vocab_size": 32000,)", ""), "vocab_size"},
      {replace(kMixtral, R"("vocab_size": 32000)", R"("vocab_size": "many")"), "wrong type"},
      {replace(kMixtral, R"("use_cache": true)", R"("use_cache": true, "shared_expert_size": 4)"), "unknown field"},
      {replace(kMixtral, R"("sliding_window": null)", R"("sliding_window": 4096)"), "sliding_window"},
      {replace(kMixtral, R"("hidden_act": "silu")", R"("hidden_act": "gelu")"), "hidden_act"},
      {"{", "not valid JSON"},
  };
  for (const auto& c : cases) {
    try {
      parse_model_config(c.json, "config.json");
      ADD_FAILURE() << "accepted a config with: " << c.cause;
    } catch (const Error& e) {
      EXPECT_EQ(e.exit_code(), 2);
      EXPECT_NE(std::string(e.what()).find(c.cause), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << "one line: " << e.what();
    }
  }
}

}  // namespace
}  // namespace moex
