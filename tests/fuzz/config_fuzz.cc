// libFuzzer target for config.json parsing: any byte string is either a config the loader can size or a
// moex::Error, never a crash, an overflow (UBSan) or a silent truncation. `make fuzz` runs it.
#include <cstddef>
#include <cstdint>
#include <string>

#include "moex/base/error.h"
#include "moex/model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  moex::ModelConfig config;
  try {
    config = moex::parse_model_config(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
  } catch (const moex::Error&) {
    return 0;
  }
  // An accepted config must be one whose sizes the loader can multiply without overflow.
  volatile int64_t sink = config.total_params() + config.active_params_per_token() + config.q_dim() + config.kv_dim();
  (void)sink;
  // And what gen-model would write for it reads back as the same model.
  const moex::ModelConfig back = moex::parse_model_config(moex::model_config_to_json(config), "round trip");
  if (back.vocab_size != config.vocab_size || back.hidden_size != config.hidden_size ||
      back.intermediate_size != config.intermediate_size || back.num_hidden_layers != config.num_hidden_layers ||
      back.num_attention_heads != config.num_attention_heads || back.num_key_value_heads != config.num_key_value_heads ||
      back.head_dim != config.head_dim || back.num_local_experts != config.num_local_experts ||
      back.num_experts_per_tok != config.num_experts_per_tok || back.rms_norm_eps != config.rms_norm_eps ||
      back.rope_theta != config.rope_theta || back.norm_topk_prob != config.norm_topk_prob ||
      back.tie_word_embeddings != config.tie_word_embeddings || back.eos_token_id != config.eos_token_id ||
      moex::model_config_to_json(back) != moex::model_config_to_json(config))  // every family field too
    __builtin_trap();
  return 0;
}
