// `moex profile`: where a step's time goes. Runs B synthetic prompts of P tokens and N decode steps after a
// warm-up that is not recorded, then prints the breakdown table (prefill and decode apart) and the expert
// load per layer; --json for machines, --trace for Perfetto. Under mpirun every rank runs and rank 0 prints.
#include <cstdio>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "moex/base/threads.h"
#include "moex/comm/communicator.h"
#include "moex/moe/eplb.h"
#include "moex/profile/report.h"
#include "moex/runtime/generation.h"
#include "tools/moex/command.h"
#include "tools/moex/model_flags.h"
#include "tools/moex/plan_experts.h"
#include "tools/moex/profile_flags.h"

namespace moex::tools {
namespace {

struct ProfileCommandFlags : SyntheticRunFlags {
  ProfileCommandFlags() : SyntheticRunFlags(64) {}
  ModelFlags model;
  int warmup = 4;
  std::string trace;
  bool json = false;
  std::string record_load;  // --record-load FILE: tokens per expert of the measured run (moex plan-experts)
  bool force = false;
};

// The measured run's tokens per expert (prefill and decode), summed over the ranks when each routes its own
// tokens (attention DP); under TP attention every rank routed every token and holds the whole count already.
eplb::RecordedLoad measured_load(const DecoderModel& model, const profile::Report& report, int64_t steps) {
  const ModelConfig& c = model.config();
  eplb::RecordedLoad load;
  load.experts = c.num_local_experts;
  load.steps = steps;
  std::vector<float> flat(static_cast<size_t>(c.num_hidden_layers) * c.num_local_experts, 0.0f);
  for (const profile::PhaseReport& p : report.phases)
    for (size_t l = 0; l < p.tokens_per_expert.size() && l < static_cast<size_t>(c.num_hidden_layers); ++l)
      for (size_t e = 0; e < p.tokens_per_expert[l].size() && e < static_cast<size_t>(c.num_local_experts); ++e)
        flat[l * c.num_local_experts + e] += static_cast<float>(p.tokens_per_expert[l][e]);
  const ParallelPlan& plan = model.options().plan;
  if (plan.attn == AttnParallel::kDP && !plan.single()) {  // exact in f32 below 2^24 tokens per expert
    std::vector<uint16_t> unused;
    comm::allreduce_f32(comm::world(), flat.data(), flat.size(), comm::CommDType::kF32, unused);
  }
  for (int l = 0; l < c.num_hidden_layers; ++l)
    load.layers.push_back(c.moe_layer(l) ? std::vector<double>(flat.begin() + int64_t{l} * c.num_local_experts,
                                                               flat.begin() + int64_t{l + 1} * c.num_local_experts)
                                         : std::vector<double>{});
  return load;
}

void run_profile(ProfileCommandFlags& f) {
  f.check();
  MOEX_CHECK_INPUT(f.record_load.empty() || f.force || !std::filesystem::exists(f.record_load), "--record-load ",
                   f.record_load, " exists: pass --force to replace it");
  MOEX_CHECK_INPUT(f.warmup >= 0 && f.warmup <= kMaxBenchTokens, "--warmup must be in 0..", kMaxBenchTokens);
  // +1: generate() samples the first new token from the prefill logits, so N decode steps make N+1 tokens.
  f.model.max_seq_len = std::max(f.model.max_seq_len, f.prompt_len + std::max(f.steps, f.warmup) + 2);
  auto model = f.model.load(f.batch);
  const ModelConfig& c = model->config();
  const std::vector<std::vector<int>> prompts = f.prompts(c.vocab_size);

  ProfileFlags profile;
  profile.record = true;
  profile.table = !f.json;
  profile.trace = f.trace;
  profile.start();
  if (f.warmup > 0) {  // pages in the weights and sizes the buffers; the same shape, shorter
    GenerationOptions warm;
    warm.max_new_tokens = f.warmup + 1;
    warm.stop_at_eos = false;
    generate(*model, prompts, warm);
  }
  profile.after_warmup();
  GenerationOptions options;
  options.max_new_tokens = f.steps + 1;
  options.stop_at_eos = false;
  const GenerationResult result = generate(*model, prompts, options);

  const bool rank0 = comm::world().rank() == 0;
  if (!f.json && rank0) {
    std::printf("moex profile: %s, batch %d, prompt %d tokens, %lld decode steps, threads %d, ranks %d\n",
                f.model.model_dir.c_str(), f.batch, f.prompt_len, static_cast<long long>(result.decode_steps),
                num_threads(), comm::world().size());
    std::printf("model: %d layers, hidden %d, %d experts (top %d), router fusion %s, weights: experts %s, dense %s; "
                "warm-up of %d decode steps not counted\n\n",
                c.num_hidden_layers, c.hidden_size, c.num_local_experts, c.num_experts_per_tok,
                f.model.router_fusion.c_str(), model->options().expert_weights.name().c_str(),
                model->options().dense_weights.name().c_str(), f.warmup);
  }
  const profile::Report mine = profile::collect();  // before finish(): the sum below is no part of the run
  nlohmann::json report = profile.finish(stdout, /*expert_detail=*/true);
  if (!f.json && rank0 && model->options().eplb_interval > 0)
    std::printf("eplb: %lld rebalances (warm-up included), %lld experts read on rank 0\n",
                static_cast<long long>(model->rebalances()), static_cast<long long>(model->experts_moved()));
  if (!f.record_load.empty()) {
    const eplb::RecordedLoad load = measured_load(*model, mine, result.decode_steps);
    if (comm::world().rank() == 0) write_new_text_file("--record-load", f.record_load, f.force, eplb::load_json(load));
  }
  if (f.json && rank0) {
    const nlohmann::json out = {{"model", f.model.model_dir},
                                {"batch", f.batch},
                                {"prompt_len", f.prompt_len},
                                {"steps", result.decode_steps},
                                {"warmup", f.warmup},
                                {"threads", num_threads()},
                                {"world", comm::world().size()},
                                {"num_layers", c.num_hidden_layers},
                                {"num_experts", c.num_local_experts},
                                {"top_k", c.num_experts_per_tok},
                                {"eplb_rebalances", model->rebalances()},
                                {"eplb_experts_moved", model->experts_moved()},
#ifdef MOEX_PROFILE_ZONES_OFF
                                {"zones_compiled", false},
#else
                                {"zones_compiled", true},
#endif
                                {"profile", std::move(report)}};
    std::printf("%s\n", out.dump().c_str());
  }
}

void setup_profile(CLI::App& app) {
  auto flags = std::make_shared<ProfileCommandFlags>();
  auto* cmd = app.add_subcommand("profile", "Where a step's time goes: zones per phase, expert load, trace");
  flags->model.add_to(cmd);
  flags->SyntheticRunFlags::add_to(cmd, "Decode steps measured");
  cmd->add_option("--warmup", flags->warmup, "Decode steps of an unrecorded warm-up run (0: none)")
      ->capture_default_str();
  cmd->add_option("--trace", flags->trace, "Write a Chrome trace (JSON; open in ui.perfetto.dev) to this file");
  cmd->add_flag("--json", flags->json, "Machine-readable output");
  add_output_flag(cmd, "--record-load", flags->record_load,
                  "Write the run's tokens per expert (JSON) for `moex plan-experts --load`");
  cmd->add_flag("--force", flags->force, "Replace an existing --record-load file");
  cmd->callback([flags] { run_profile(*flags); });
}
MOEX_REGISTER_COMMAND(setup_profile);

}  // namespace
}  // namespace moex::tools
