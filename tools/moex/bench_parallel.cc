// `moex bench parallel-sweep` (also `moex bench --parallel-sweep`): how each parallel plan performs, measured.
// For each plan (TP=N, EP=N, TP x EP), with and without overlap, and each comm dtype: decode at batch
// 1/16/64 and a prefill, with tokens/s, the share of step time in communication, bytes each rank puts on
// the wire per token per layer, and the algorithms that ran for the MoE all-reduce (all-to-all under dp
// attention), as the profiler recorded them. Run under mpirun.
#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>

#include <nlohmann/json.hpp>

#include "moex/profile/profile.h"
#include "moex/profile/report.h"
#include "moex/profile/trace.h"
#include "moex/runtime/generation.h"
#include "tools/lib/synthetic.h"
#include "tools/moex/bench.h"
#include "tools/moex/flags.h"
#include "tools/moex/model_flags.h"
#include "tools/moex/profile_flags.h"

namespace moex::tools {
namespace {

struct SweepFlags {
  ModelFlags model;
  std::vector<int> batches = {1, 16, 64};
  int prompt_len = 8;
  int prefill_len = 128;
  int steps = 4;
  bool json = false;
};

struct SweepRow {
  std::string plan, dtype, workload, algorithms_ran;
  bool overlap = false;
  double tokens_per_s = 0, comm_share = 0, bytes_per_token_layer = 0;
};

double comm_share(const profile::PhaseReport& phase) {
  double share = 0;
  for (profile::Zone z : {profile::Zone::kAllReduce, profile::Zone::kAllToAll, profile::Zone::kAllGather,
                          profile::Zone::kReduceScatter, profile::Zone::kBroadcast})
    share += phase.share(z);
  return share;
}

// The algorithms of the `zone` collectives this rank ran in `phase` (the profiler records each call's),
// most calls first, joined by '+': "shm", or "rabenseifner+shm" when sizes called for different ones.
std::string algorithms_ran(const profile::RankTrace& trace, profile::Zone zone, profile::Phase phase) {
  std::map<std::string, int64_t> calls;
  for (const profile::ThreadTrace& thread : trace.threads)
    for (const profile::TraceSlice& slice : thread.slices)
      if (slice.comm >= 0 && slice.zone == zone && slice.phase == phase) ++calls[thread.comm[slice.comm].algorithm];
  std::vector<std::pair<int64_t, std::string>> order;
  for (const auto& [name, count] : calls) order.emplace_back(-count, name);
  std::sort(order.begin(), order.end());
  std::string out;
  for (const auto& [count, name] : order) out += (out.empty() ? "" : "+") + name;
  return out.empty() ? "-" : out;
}

uint64_t comm_bytes(const profile::PhaseReport& phase) {
  uint64_t bytes = 0;
  for (const auto& c : phase.comm) bytes += c.bytes_sent;
  return bytes;
}

void run_sweep(SweepFlags& f) {
  comm::Communicator& world = f.model.world();
  const int n = world.size();
  const ModelConfig config = load_checkpoint_config(f.model.model_dir);
  struct PlanChoice {
    std::string name, moe, attn;
    int tp, ep;
  };
  std::vector<PlanChoice> plans = {{"TP=" + std::to_string(n), "tp", "tp", n, 1},
                                   {"EP=" + std::to_string(n), "ep", "tp", 1, n},
                                   {"EP=" + std::to_string(n) + " dp-attn", "ep", "dp", 1, n}};
  if (n % 2 == 0 && n > 2) plans.push_back({"TP=2 x EP=" + std::to_string(n / 2), "tpxep", "tp", 2, n / 2});
  const int max_batch = *std::max_element(f.batches.begin(), f.batches.end());
  // +1: the engine samples a token after the prefill workload's prompt too (its context holds it).
  f.model.max_seq_len = std::max(f.prefill_len + 1, f.prompt_len + f.steps + 2);
  // One step takes every prompt of a decode workload: the engine then decodes all sequences together, as the
  // workload means (a smaller budget staggers the prompts over steps, and the tail steps carry fewer rows).
  f.model.max_step_tokens = std::max(f.prefill_len, max_batch * f.prompt_len);
  std::vector<SweepRow> rows;
  ProfileFlags profiling;
  profiling.record = true;
  profiling.start();
  for (const PlanChoice& choice : plans) {
    for (bool overlap : {false, true}) {
      if (overlap && choice.attn == "dp") continue;  // dp attention uses all-to-all, not a reducible sum
      for (const std::string dtype : {"f32", "bf16", "fp8"}) {
        ModelFlags flags = f.model;
        flags.plan = {choice.moe, choice.attn, choice.tp, choice.ep, dtype, overlap};
        flags.threads = 1;  // ranks already oversubscribe the cores
        std::unique_ptr<DecoderModel> model;
        try {
          model = flags.load(max_batch);
        } catch (const Error& e) {  // a plan this model cannot take (e.g. heads % N): say so, go on
          if (world.rank() == 0) std::printf("skip %s: %s\n", choice.name.c_str(), e.what());
          break;
        }
        const auto measure = [&](const std::string& workload, int batch, int prompt_len, int new_tokens) {
          const std::vector<std::vector<int>> prompts = synthetic_prompts(batch, prompt_len, config.vocab_size);
          GenerationOptions options;
          options.max_new_tokens = new_tokens;
          options.stop_at_eos = false;
          generate(*model, prompts, options);  // warm-up
          profile::reset();
          const GenerationResult r = generate(*model, prompts, options);
          const profile::Report report = profile::collect();
          const bool prefill = new_tokens == 0;
          const profile::PhaseReport& phase = report.phase(prefill ? profile::Phase::kPrefill : profile::Phase::kDecode);
          SweepRow row;
          row.plan = choice.name;
          row.dtype = dtype;
          row.overlap = overlap;
          row.workload = workload;
          row.tokens_per_s = prefill ? r.prefill_tokens / std::max(r.prefill_seconds, 1e-9)
                                     : r.decode_tokens / std::max(r.decode_seconds, 1e-9);
          row.comm_share = comm_share(phase);
          const double tokens = static_cast<double>(std::max<int64_t>(phase.tokens, 1));
          row.bytes_per_token_layer = comm_bytes(phase) / tokens / config.num_hidden_layers;
          row.algorithms_ran =
              algorithms_ran(profile::collect_trace(), choice.attn == "dp" ? profile::Zone::kAllToAll : profile::Zone::kAllReduce,
                             prefill ? profile::Phase::kPrefill : profile::Phase::kDecode);
          rows.push_back(row);
          if (world.rank() == 0 && !f.json)
            std::printf("%-18s %-7s %-5s %-12s %10.1f %9.1f%% %14.0f  %s\n", row.plan.c_str(), overlap ? "yes" : "no",
                        dtype.c_str(), workload.c_str(), row.tokens_per_s, 100 * row.comm_share,
                        row.bytes_per_token_layer, row.algorithms_ran.c_str());
          std::fflush(stdout);
        };
        if (world.rank() == 0 && !f.json && rows.empty()) {
          std::printf("parallel sweep on %d ranks, model %s (%d layers). This machine has 2 cores: %d ranks share them,\n"
                      "so absolute speed-ups across ranks are not the point here - the bytes, the shares and the\n"
                      "correctness are.\n\n",
                      n, f.model.model_dir.c_str(), config.num_hidden_layers, n);
          std::printf("%-18s %-7s %-5s %-12s %10s %10s %14s  %s\n", "plan", "overlap", "comm", "workload", "tokens/s",
                      "comm share", "bytes/tok/layer", "algorithm that ran");
        }
        for (int batch : f.batches) measure("decode b=" + std::to_string(batch), batch, f.prompt_len, f.steps);
        measure("prefill " + std::to_string(f.prefill_len), 1, f.prefill_len, 0);
        // Expert load per rank under EP (tokens are replicated under tp attention, so the stats are global).
        if (choice.moe == "ep" && choice.attn == "tp" && !overlap && dtype == "f32" && world.rank() == 0) {
          const auto& stats = model->moe_stats();
          double worst = 0;
          for (const MoELoadStats& s : stats) {
            std::vector<double> per_rank(n, 0);
            for (size_t e = 0; e < s.tokens_per_expert.size(); ++e)
              per_rank[e / (s.tokens_per_expert.size() / n)] += s.tokens_per_expert[e];
            double total = 0, busiest = 0;
            for (double v : per_rank) total += v, busiest = std::max(busiest, v);
            if (total > 0) worst = std::max(worst, busiest * n / total);
          }
          if (!f.json) std::printf("  EP expert load per rank (last prefill): max/mean %.2f over layers\n", worst);
        }
      }
    }
  }
  if (world.rank() == 0 && f.json) {
    nlohmann::json out = nlohmann::json::array();
    for (const SweepRow& r : rows)
      out.push_back({{"plan", r.plan}, {"overlap", r.overlap}, {"comm_dtype", r.dtype}, {"workload", r.workload},
                     {"tokens_per_s", r.tokens_per_s}, {"comm_share", r.comm_share},
                     {"bytes_per_token_per_layer", r.bytes_per_token_layer}, {"algorithms_ran", r.algorithms_ran}});
    std::printf("%s\n", nlohmann::json{{"ranks", n}, {"rows", out}}.dump(1).c_str());
  }
}

void setup_parallel_sweep(CLI::App& bench) {
  auto flags = std::make_shared<SweepFlags>();
  auto* cmd = bench.add_subcommand("parallel-sweep", "Every parallel plan side by side (run under mpirun)");
  flags->model.add_to(cmd);
  add_list_flag(cmd, "--batches", flags->batches, "Decode batch sizes")->check(whole_number_in(1, 1 << 16));
  cmd->add_option("--prompt-len", flags->prompt_len, "Prompt tokens per sequence before decoding")->capture_default_str();
  cmd->add_option("--prefill-len", flags->prefill_len, "Prompt tokens of the prefill workload")->capture_default_str();
  cmd->add_option("--steps", flags->steps, "Decode steps per measurement")->capture_default_str();
  cmd->add_flag("--json", flags->json, "Machine-readable output");
  cmd->callback([flags] { run_sweep(*flags); });
}
MOEX_REGISTER_BENCH(setup_parallel_sweep);

}  // namespace
}  // namespace moex::tools
