// `moex bench router`: microseconds per layer of the MoE router for each fusion mode, against the bare
// gating matmul (logits written to memory, nothing else: the floor), at several T, all in one run.
// Mixtral 8x7B dims by default (d 4096, E 8, k 2, BF16 gate). The gates of `--layers` layers are cycled
// so the gate comes from L3 as it does in a model, not from L1 left hot by the previous call.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>

#include <nlohmann/json.hpp>

#include "moex/base/dtype.h"
#include "moex/base/threads.h"
#include "moex/kernels/matmul.h"
#include "moex/moe/gating.h"
#include "tools/moex/bench.h"
#include "tools/moex/flags.h"

namespace moex::tools {
namespace {

struct RouterFlags : MoEShapeFlags {
  RouterFlags() : MoEShapeFlags({1, 16, 64, 256, 2048}, 32) {}
  int repeats = 21;
  double sample_ms = 2.0;
  ThreadsFlags threads;
  bool cpu_clock = false;
  bool json = false;
};

void run_router(const RouterFlags& f) {
  f.check();
  f.threads.apply();
  const int64_t d = f.hidden, E = f.experts;
  const int max_tokens = f.max_tokens();
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(max_tokens) * d);
  for (float& v : x) v = normal(rng);
  // gate [layers][E, d] BF16 ~ N(0, 1/d): logits ~ N(0, 1) as in a trained router.
  std::vector<uint16_t> gates(static_cast<size_t>(f.layers) * E * d);
  for (uint16_t& v : gates) v = f32_to_bf16(normal(rng) / std::sqrt(static_cast<float>(d)));
  std::vector<TensorView> gate_views;
  for (int l = 0; l < f.layers; ++l)
    gate_views.push_back(TensorView{gates.data() + static_cast<size_t>(l) * E * d, DType::kBF16, Shape{E, d}});

  std::vector<float> logits(static_cast<size_t>(max_tokens) * E);
  std::vector<int32_t> ids(static_cast<size_t>(max_tokens) * f.top_k);
  std::vector<float> weights(ids.size());
  const RouterFusion modes[] = {RouterFusion::kNone, RouterFusion::kTopkSoftmax, RouterFusion::kFull};
  std::vector<std::unique_ptr<GatingTopK>> routers;
  for (RouterFusion m : modes) routers.push_back(std::make_unique<GatingTopK>(f.experts, f.top_k, m));

  nlohmann::json rows = nlohmann::json::array();
  if (!f.json) {
    std::printf("router: d %lld, E %lld, k %d, BF16 gate, %d layers cycled, %d threads; us per layer, median of %d\n",
                static_cast<long long>(d), static_cast<long long>(E), f.top_k, f.layers, num_threads(), f.repeats);
    std::printf("%6s %10s %10s | %10s %12s %10s | %9s %9s\n", "T", "matmul", "mm_nsplit", "none", "topk_softmax",
                "full", "full/mm", "full/none");
  }
  const TimingOptions timing{.repeats = f.repeats, .sample_ms = f.sample_ms, .cpu_clock = f.cpu_clock};
  for (int T : f.tokens) {
    int layer = 0;
    const auto next_gate = [&]() -> const TensorView& {
      layer = (layer + 1) % f.layers;
      return gate_views[layer];
    };
    // The floor: what the unfused modes' first pass costs (threads split tokens).
    const double matmul =
        measure_median(timing, [&] { gating::router_logits(x.data(), T, next_gate(), logits.data()); }).seconds;
    // kernels::matmul as the dense layers use it (threads split the E rows: one thread for E=8), for reference.
    const double matmul_nsplit =
        measure_median(timing, [&] { kernels::matmul(x.data(), T, next_gate(), logits.data()); }).seconds;
    double mode_seconds[3];
    for (int m = 0; m < 3; ++m) {
      GatingTopK& router = *routers[m];
      mode_seconds[m] =
          measure_median(timing, [&] { router.route(x.data(), T, next_gate(), ids.data(), weights.data()); }).seconds;
    }
    const double full = mode_seconds[2];
    if (f.json) {
      rows.push_back({{"tokens", T}, {"matmul_us", matmul * 1e6}, {"matmul_nsplit_us", matmul_nsplit * 1e6},
                      {"none_us", mode_seconds[0] * 1e6}, {"topk_softmax_us", mode_seconds[1] * 1e6},
                      {"full_us", full * 1e6}, {"full_over_matmul", full / matmul},
                      {"full_over_none", full / mode_seconds[0]}});
    } else {
      std::printf("%6d %10.2f %10.2f | %10.2f %12.2f %10.2f | %8.2fx %8.2fx\n", T, matmul * 1e6, matmul_nsplit * 1e6,
                  mode_seconds[0] * 1e6, mode_seconds[1] * 1e6, full * 1e6, full / matmul, full / mode_seconds[0]);
    }
  }
  if (f.json) {
    std::printf("%s\n", nlohmann::json{{"hidden", d}, {"experts", E}, {"top_k", f.top_k}, {"gate_dtype", "bf16"},
                                       {"layers", f.layers}, {"threads", num_threads()}, {"repeats", f.repeats}, {"cpu_clock", f.cpu_clock},
                                       {"results", rows}}.dump().c_str());
  } else {
    std::printf("matmul: the bare gating matmul, logits to memory (the floor); mm_nsplit: kernels::matmul "
                "(threads split E). Goal: full <= 1.25x matmul, full <= none.\n");
  }
}

void setup_router_bench(CLI::App& bench) {
  auto flags = std::make_shared<RouterFlags>();
  auto* cmd = bench.add_subcommand("router", "MoE router: each fusion mode against the bare gating matmul");
  flags->MoEShapeFlags::add_to(cmd, "Gates cycled through (keeps them out of L1/L2)");
  cmd->add_option("--repeats", flags->repeats, "Samples per cell (median reported)")->capture_default_str();
  cmd->add_option("--sample-ms", flags->sample_ms, "Length of one sample")->capture_default_str();
  flags->threads.add_to(cmd);
  cmd->add_flag("--cpu-clock", flags->cpu_clock,
                "Time on the thread's CPU clock (use with --threads 1 when other processes load the machine)");
  cmd->add_flag("--json", flags->json, "Machine-readable output");
  cmd->callback([flags] { run_router(*flags); });
}
MOEX_REGISTER_BENCH(setup_router_bench);

}  // namespace
}  // namespace moex::tools
