// `moex plan-experts`: an EPLB placement (moe/eplb.h) from a recorded load: per MoE layer, replica counts and
// their packing onto --ranks EP ranks with E/N + --redundant-experts slots each, balanced over --hosts first when
// given. Prints each layer's expected balancedness before (plain EP) and after.
#include "tools/moex/plan_experts.h"

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "moex/base/error.h"
#include "moex/base/small_file.h"
#include "moex/model/gguf.h"
#include "moex/moe/eplb.h"
#include "tools/lib/output_dir.h"
#include "tools/moex/command.h"
#include "tools/moex/flags.h"

namespace moex::tools {

void write_new_text_file(const std::string& flag, const std::string& out, bool force, const std::string& text) {
  namespace fs = std::filesystem;
  MOEX_CHECK_INPUT(!out.empty(), flag, " must name a file");
  std::error_code ec;
  MOEX_CHECK_INPUT(force || !fs::exists(out, ec), flag, " ", out, " exists: pass --force to replace it");
  const fs::path dir = fs::path(out).parent_path();
  if (!dir.empty()) fs::create_directories(dir, ec);
  StagingFile staged(out, "eplb");
  {
    std::ofstream f(staged.path(), std::ios::binary);
    f << text;
    f.close();
    MOEX_CHECK_INPUT(f.good(), flag, " ", out, ": write failed");
  }
  staged.publish();
}

namespace {

struct PlanExpertsFlags {
  std::string model_dir, load, out;
  int ranks = 0, redundant = 0, hosts = 1;
  bool force = false;
};

void run_plan_experts(const PlanExpertsFlags& f) {
  std::error_code ec;
  MOEX_CHECK_INPUT(f.force || !std::filesystem::exists(f.out, ec), "--out ", f.out, " exists: pass --force to replace it");
  const ModelConfig config = load_checkpoint_config(f.model_dir);
  const int E = config.num_local_experts;
  MOEX_CHECK_INPUT(f.ranks >= 1 && E % f.ranks == 0, "--ranks ", f.ranks, ": the model's ", E,
                   " experts must split evenly over the EP ranks");
  MOEX_CHECK_INPUT(f.redundant >= 0, "--redundant-experts must be >= 0");
  MOEX_CHECK_INPUT(f.hosts >= 1 && f.ranks % f.hosts == 0, "--hosts ", f.hosts, " must divide --ranks ", f.ranks);
  eplb::RecordedLoad load;
  try {
    load = eplb::parse_load_json(read_small_file(f.load, size_t{64} << 20));
  } catch (const Error& e) {
    throw_input_error("--load " + f.load, e.what());
  }
  MOEX_CHECK_INPUT(load.experts == E && static_cast<int>(load.layers.size()) == config.num_hidden_layers, "--load ",
                   f.load, ": recorded for ", load.experts, " experts and ", load.layers.size(), " layers; the model has ",
                   E, " and ", config.num_hidden_layers);
  eplb::ModelPlacement placement;
  placement.experts = E;
  placement.ranks = f.ranks;
  placement.slots_per_rank = E / f.ranks + f.redundant;
  std::vector<int> rank_host;  // ranks fill hosts in order, as mpirun's by-slot mapping does
  if (f.hosts > 1)
    for (int r = 0; r < f.ranks; ++r) rank_host.push_back(r / (f.ranks / f.hosts));
  std::printf("moex plan-experts: %d experts over %d ranks (%d host%s), %d slots per rank; load of %lld steps\n", E,
              f.ranks, f.hosts, f.hosts > 1 ? "s" : "", placement.slots_per_rank, static_cast<long long>(load.steps));
  std::printf("  %-6s %12s %12s %s\n", "layer", "bal. before", "bal. after", "replicas per expert");
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    if (!config.moe_layer(l)) {
      MOEX_CHECK_INPUT(load.layers[l].empty(), "--load ", f.load, ": layer ", l, " is dense but has a load");
      placement.layers.emplace_back();
      continue;
    }
    MOEX_CHECK_INPUT(!load.layers[l].empty(), "--load ", f.load, ": MoE layer ", l, " has no load");
    eplb::Placement p = eplb::place_experts(load.layers[l], f.ranks, placement.slots_per_rank, rank_host);
    const double before = eplb::balancedness(eplb::rank_loads(eplb::block_placement(E, f.ranks), load.layers[l]));
    const double after = eplb::balancedness(eplb::rank_loads(p, load.layers[l]));
    std::printf("  %-6d %12.3f %12.3f ", l, before, after);
    for (int e = 0; e < E && e < 32; ++e) std::printf(" %d", p.replicas(e));
    std::printf("\n");
    placement.layers.push_back(std::move(p));
  }
  write_new_text_file("--out", f.out, f.force, eplb::placement_json(placement));
  std::printf("wrote %s\n", f.out.c_str());
}

void setup_plan_experts(CLI::App& app) {
  auto f = std::make_shared<PlanExpertsFlags>();
  auto* cmd = app.add_subcommand("plan-experts", "An EPLB expert placement from a recorded load (profile --record-load)");
  cmd->add_option("--model", f->model_dir, "Model folder (its config.json)")->required();
  cmd->add_option("--load", f->load, "The load `moex profile --record-load` wrote")->required();
  cmd->add_option("--ranks", f->ranks, "EP ranks")->required();
  cmd->add_option("--redundant-experts", f->redundant, "Extra expert slots per EP rank")->capture_default_str();
  cmd->add_option("--hosts", f->hosts, "Hosts the ranks fill in order (> 1: hierarchical placement)")->capture_default_str();
  add_output_flag(cmd, "--out", f->out, "The placement file to write (JSON)")->required();
  cmd->add_flag("--force", f->force, "Replace an existing --out");
  cmd->callback([f] { run_plan_experts(*f); });
}
MOEX_REGISTER_COMMAND(setup_plan_experts);

}  // namespace
}  // namespace moex::tools
