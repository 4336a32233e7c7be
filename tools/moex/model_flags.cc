#include "tools/moex/model_flags.h"

#include "moex/base/threads.h"

namespace moex::tools {

void ModelFlags::add_to(CLI::App* cmd) {
  cmd->add_option("--model", model_dir, "Hugging Face model folder (config.json + safetensors)")->required();
  cmd->add_option("--max-seq-len", max_seq_len, "KV cache length per sequence")->capture_default_str();
  cmd->add_option("--step-tokens", max_step_tokens, "Most tokens in one forward call (prefill chunk)")
      ->capture_default_str();
  cmd->add_option("--router-fusion", router_fusion, "Router: none | topk_softmax | full")->capture_default_str();
  cmd->add_option("--capacity-factor", capacity_factor, "Expert capacity factor; <= 0 is dropless")
      ->capture_default_str();
  cmd->add_option("--threads", threads, "Threads (0: all cores)")->capture_default_str();
}

std::unique_ptr<MixtralModel> ModelFlags::load(int batch) const {
  set_num_threads(threads);
  ModelOptions options;
  options.max_seq_len = max_seq_len;
  options.max_batch = batch;
  options.max_step_tokens = max_step_tokens;
  options.router_fusion = router_fusion_from_name(router_fusion);
  options.capacity_factor = capacity_factor;
  return std::make_unique<MixtralModel>(model_dir, options);
}

}  // namespace moex::tools
