// `moex logits`: logits of every prompt position, then of N greedy decode steps, as float32 .npy
// [positions, vocab]; the interface other engines (and the PyTorch reference) are checked against.
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "moex/runtime/generation.h"
#include "moex/runtime/npy.h"
#include "moex/runtime/sampler.h"
#include "tools/moex/command.h"
#include "tools/moex/model_flags.h"

namespace moex::tools {
namespace {

struct LogitsFlags {
  ModelFlags model;
  std::string ids;
  int decode_steps = 0;
  std::string out;
  std::string tokens_out;
  std::string stats_out;
};

// Per-layer MoE load of the prompt's forward call, in the keys of tests/reference/mixtral_ref.py --stats-out:
// tokens_per_expert counts routed assignments (before capacity); kept_per_expert what capacity let through.
void write_moe_stats(const std::string& path, const MixtralModel& model, int64_t tokens) {
  nlohmann::json layers = nlohmann::json::array();
  for (const MoELoadStats& s : model.moe_stats()) {
    std::vector<int> routed(s.tokens_per_expert.size());
    for (size_t e = 0; e < routed.size(); ++e) routed[e] = s.tokens_per_expert[e] + s.drops_per_expert[e];
    layers.push_back({{"tokens_per_expert", routed}, {"kept_per_expert", s.tokens_per_expert},
                      {"drops_per_expert", s.drops_per_expert}, {"drops", s.drops}, {"capacity", s.capacity}});
  }
  const float factor = model.options().capacity_factor;
  const int64_t capacity = MoEDynamicBatch::capacity_for(tokens, model.config().num_local_experts,
                                                         model.config().num_experts_per_tok, factor);
  nlohmann::json report{{"num_tokens", tokens}, {"capacity_factor", factor > 0 ? nlohmann::json(factor) : nullptr},
                        {"capacity", capacity > 0 ? nlohmann::json(capacity) : nullptr}, {"layers", layers}};
  std::ofstream f(path);
  MOEX_CHECK_INPUT(f.good(), "cannot write ", path);
  f << report.dump(1) << "\n";
}

void run_logits(const LogitsFlags& flags) {
  const std::vector<int> prompt = parse_int_list(flags.ids, "--ids");
  MOEX_CHECK_INPUT(flags.decode_steps >= 0, "--decode must be >= 0");
  auto model = flags.model.load(1);
  const int vocab = model->config().vocab_size;
  const int64_t rows = static_cast<int64_t>(prompt.size()) + flags.decode_steps;
  MOEX_CHECK_INPUT(rows <= model->options().max_seq_len, "prompt + --decode is ", rows,
                   " positions: increase --max-seq-len to at least ", rows);
  std::vector<float> logits(static_cast<size_t>(rows) * vocab), last(vocab);
  if (!flags.stats_out.empty())
    MOEX_CHECK_INPUT(static_cast<int64_t>(prompt.size()) <= model->options().max_step_tokens,
                     "--stats-out describes the prompt as one forward call: increase --step-tokens to at least ",
                     prompt.size());
  // Under attention DP the sequence lives on rank 0; the other ranks join each step's collectives.
  const ParallelPlan& plan = model->options().plan;
  const bool owner = rank_serves_sequence(plan, 0);
  if (owner) {
    prefill(*model, 0, prompt, last.data(), logits.data());
  } else {
    for (int64_t i = 0; i < prefill_steps(*model, static_cast<int64_t>(prompt.size())); ++i) idle_step(*model);
  }
  if (!flags.stats_out.empty() && plan.rank == 0)
    write_moe_stats(flags.stats_out, *model, static_cast<int64_t>(prompt.size()));
  std::vector<int> generated;
  int32_t slot = 0;
  for (int step = 0; step < flags.decode_steps; ++step) {
    if (!owner) {
      idle_step(*model);
      continue;
    }
    const int32_t token = argmax(last.data(), vocab);
    const int32_t position = static_cast<int32_t>(prompt.size()) + step;
    generated.push_back(token);
    StepInput input;
    input.tokens = &token;
    input.seq_slots = &slot;
    input.positions = &position;
    input.num_tokens = 1;
    float* row = logits.data() + static_cast<size_t>(position) * vocab;
    model->forward(input, row);
    std::copy(row, row + vocab, last.begin());
  }
  if (plan.rank != 0) return;  // rank 0 serves sequence 0 under every plan and writes the results
  write_npy_f32(flags.out, logits.data(), {rows, vocab});
  if (!flags.tokens_out.empty()) {
    FILE* f = std::fopen(flags.tokens_out.c_str(), "w");
    MOEX_CHECK_INPUT(f != nullptr, "cannot write ", flags.tokens_out);
    for (int t : generated) std::fprintf(f, "%d\n", t);
    std::fclose(f);
  }
  std::printf("wrote %s: [%lld, %d] float32 (%zu prompt positions, %d decode steps)\n", flags.out.c_str(),
              static_cast<long long>(rows), vocab, prompt.size(), flags.decode_steps);
}

void setup_logits(CLI::App& app) {
  auto flags = std::make_shared<LogitsFlags>();
  auto* cmd = app.add_subcommand("logits", "Write the logits of a prompt (and N greedy decode steps) as .npy");
  flags->model.add_to(cmd);
  cmd->add_option("--ids", flags->ids, "Prompt token ids, comma-separated")->required();
  cmd->add_option("--decode", flags->decode_steps, "Greedy decode steps after the prompt")->capture_default_str();
  cmd->add_option("--out", flags->out, "Output .npy file: float32 [positions, vocab]")->required();
  cmd->add_option("--tokens-out", flags->tokens_out, "Also write the greedy tokens, one per line");
  cmd->add_option("--stats-out", flags->stats_out, "Also write the prompt pass's per-layer MoE load and drops (JSON)");
  cmd->callback([flags] { run_logits(*flags); });
}
MOEX_REGISTER_COMMAND(setup_logits);

}  // namespace
}  // namespace moex::tools
