// `moex bench moe-layer`: one whole MoE layer (router, dynamic batching, experts, combine) against a
// per-token loop (each token runs its k experts one at a time, reading an expert's weights per token),
// Mixtral 8x7B dims by default (d 4096, I 14336, E 8, k 2). Expert weights are random BF16 in memory for
// `--layers` layers (2.8 GB each), cycled step by step so the bench measures DRAM, not the L3 cache.
// --router-skew S tilts the gate so expert popularity follows Zipf(S) (a calibrated per-expert offset on
// a constant input channel); the load each step actually produced is printed.
#include <sys/mman.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>

#include <nlohmann/json.hpp>

#include "moex/base/dtype.h"
#include "moex/base/system_memory.h"
#include "moex/base/threads.h"
#include "moex/moe/dynamic_batch.h"
#include "moex/moe/gating.h"
#include "tools/lib/synthetic.h"
#include "tools/moex/bench.h"
#include "tools/moex/flags.h"

namespace moex::tools {
namespace {

struct MoELayerFlags : MoEShapeFlags {
  MoELayerFlags() : MoEShapeFlags({1, 16, 64, 256}, 2) {}
  int intermediate = 14336;
  float router_skew = 0.0f;
  float capacity_factor = 0.0f;
  int repeats = 3;
  double budget_s = 12.0;
  ThreadsFlags threads;
  bool json = false;
};

// Anonymous mapping that is unmapped on destruction (GBs: no zero-filling std::vector).
struct Mapping {
  void* data = nullptr;
  size_t bytes = 0;
  explicit Mapping(size_t n) : bytes(n) {
    data = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    MOEX_CHECK_INPUT(data != MAP_FAILED, "cannot map ", n >> 20, " MB of expert weights: lower --layers");
  }
  ~Mapping() { ::munmap(data, bytes); }
};

// A table of BF16 values uniform in +-sqrt(3/fan_in) (unit-variance outputs); matrices are filled by copying
// it from a seed-dependent offset: random enough for timing, and GBs fill at memcpy speed.
std::vector<uint16_t> random_bf16_table(int64_t n, int64_t fan_in, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const float scale = std::sqrt(3.0f / static_cast<float>(fan_in));
  std::vector<uint16_t> table(n);
  for (uint16_t& v : table) v = f32_to_bf16(uniform(rng) * scale);
  return table;
}

void fill_from_table(uint16_t* out, int64_t n, const std::vector<uint16_t>& table, uint64_t seed) {
  const int64_t period = static_cast<int64_t>(table.size());
  parallel_for(n, period, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {
      const int64_t offset = static_cast<int64_t>((seed * 7919 + static_cast<uint64_t>(i / period) * 104729) % period);
      const int64_t len = std::min(end - i, period - offset);
      std::memcpy(out + i, table.data() + offset, len * sizeof(uint16_t));
      i += len;
    }
  });
}

// Gate offsets for --router-skew: the router sees logits ~ N(0, 1) (the gate's other channels) plus
// offset[e] times the constant channel 0 of x, which is 1; calibrated like gen-model's gate on a sample of
// such logits.
ZipfRouterCalibration calibrate_offsets(float skew, int experts, int top_k) {
  const int samples = 8192;
  std::mt19937 rng(99);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> noise(static_cast<size_t>(samples) * experts);
  for (float& v : noise) v = normal(rng);
  return calibrate_zipf_router(skew, top_k, noise, std::vector<float>(samples, 1.0f));
}

void run_moe_layer(const MoELayerFlags& f) {
  f.check();
  MOEX_CHECK_INPUT(f.intermediate > 0 && f.repeats >= 1, "--intermediate and --repeats must be > 0");
  MOEX_CHECK_INPUT(std::isfinite(f.capacity_factor), "--capacity-factor ", f.capacity_factor,
                   " must be a finite number (<= 0: dropless)");
  MOEX_CHECK_INPUT(f.router_skew >= 0 && f.router_skew <= kMaxRouterSkew, "--router-skew ", f.router_skew,
                   " must be in 0..", kMaxRouterSkew);
  f.threads.apply();
  const int64_t d = f.hidden, I = f.intermediate, E = f.experts;
  const int k = f.top_k;
  const int max_tokens = f.max_tokens();

  // Filled in full below: refuse what the machine cannot hold (in double: the product is what is checked).
  check_fits_in_memory(double(f.layers) * double(E) * 3.0 * double(I) * double(d) * 2, "the expert weights",
                       "lower --layers, --experts, --hidden or --intermediate");

  // Expert weights: [layers][E][w1 | w3 | w2], each [I, d] or [d, I], BF16.
  const int64_t matrix = I * d, per_expert = 3 * matrix;
  const size_t weight_bytes = static_cast<size_t>(f.layers) * E * per_expert * sizeof(uint16_t);
  Mapping weights_memory(weight_bytes);
  uint16_t* all = static_cast<uint16_t*>(weights_memory.data);
  std::vector<std::vector<ExpertWeights>> experts(f.layers);
  const auto gen_start = std::chrono::steady_clock::now();
  ::madvise(all, weight_bytes, MADV_HUGEPAGE);  // fewer page faults while filling GBs
  const auto table_in_d = random_bf16_table(int64_t{1} << 20, d, 1), table_in_i = random_bf16_table(int64_t{1} << 20, I, 2);
  for (int l = 0; l < f.layers; ++l) {
    for (int64_t e = 0; e < E; ++e) {
      uint16_t* base = all + (static_cast<int64_t>(l) * E + e) * per_expert;
      fill_from_table(base, matrix, table_in_d, 3 * (l * E + e) + 1);
      fill_from_table(base + matrix, matrix, table_in_d, 3 * (l * E + e) + 2);
      fill_from_table(base + 2 * matrix, matrix, table_in_i, 3 * (l * E + e) + 3);
      experts[l].push_back({TensorView{base, DType::kBF16, Shape{I, d}},
                            TensorView{base + matrix, DType::kBF16, Shape{I, d}},
                            TensorView{base + 2 * matrix, DType::kBF16, Shape{d, I}}});
    }
  }
  const double gen_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - gen_start).count();

  // Router: gate ~ N(0, 1/d) so logits ~ N(0, 1); channel 0 of x is a constant 1 and gate[e][0] holds
  // expert e's calibrated offset, which is what tilts the load (the same trick as gen-model --router-skew).
  const ZipfRouterCalibration calibration = calibrate_offsets(f.router_skew, f.experts, k);
  const std::vector<float>& offsets = calibration.gate_offset;
  std::mt19937 rng(4321);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint16_t> gate(static_cast<size_t>(E) * d);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < d; ++i) gate[e * d + i] = f32_to_bf16(normal(rng) / std::sqrt(static_cast<float>(d - 1)));
    gate[e * d] = f32_to_bf16(offsets[e]);
  }
  const TensorView gate_view{gate.data(), DType::kBF16, Shape{E, d}};
  std::vector<float> x(static_cast<size_t>(max_tokens) * d);
  for (float& v : x) v = normal(rng);
  for (int t = 0; t < max_tokens; ++t) x[static_cast<size_t>(t) * d] = 1.0f;

  GatingTopK router(f.experts, k, RouterFusion::kFull);
  MoEDynamicBatch batcher(f.experts, k, f.capacity_factor);
  const size_t max_rows = static_cast<size_t>(max_tokens) * k;
  std::vector<int32_t> ids(max_rows);
  std::vector<float> routing(max_rows), gathered(max_rows * d), hidden_gate(max_rows * I), hidden_up(max_rows * I),
      expert_out(max_rows * d), out_batched(static_cast<size_t>(max_tokens) * d),
      out_loop(static_cast<size_t>(max_tokens) * d), token_out(d);

  int step = 0;  // layers are cycled step by step, the same way for both methods
  int last_layer = 0;
  const auto batched_layer = [&](int64_t T) {
    last_layer = step++ % f.layers;
    const auto& layer = experts[last_layer];
    router.route(x.data(), T, gate_view, ids.data(), routing.data());
    batcher.plan(ids.data(), T);
    batcher.gather(x.data(), d, gathered.data());
    const auto& offsets_e = batcher.expert_offsets();
    for (int64_t e = 0; e < E; ++e) {
      const int64_t begin = offsets_e[e], rows = offsets_e[e + 1] - begin;
      if (rows == 0) continue;  // as the engine: only experts with rows run (128 experts, T = 1: 120 are empty)
      expert_ffn(layer[e], gathered.data() + begin * d, rows, hidden_gate.data() + begin * I,
                 hidden_up.data() + begin * I, expert_out.data() + begin * d);
    }
    batcher.combine(expert_out.data(), routing.data(), T, d, out_batched.data(), /*accumulate=*/false);
  };
  // Tokens [0, checked) of T through the per-token loop; `layer` < 0 cycles like the batched version.
  const auto per_token_loop = [&](int64_t T, int64_t checked, int layer_index) {
    const auto& layer = experts[layer_index >= 0 ? layer_index : step++ % f.layers];
    router.route(x.data(), T, gate_view, ids.data(), routing.data());
    batcher.plan(ids.data(), T);  // only for the capacity decisions, so both compute the same function
    const auto& assignment_row = batcher.assignment_row();
    for (int64_t t = 0; t < checked; ++t) {
      float* y = out_loop.data() + t * d;
      std::fill(y, y + d, 0.0f);
      for (int j = 0; j < k; ++j) {
        if (assignment_row[t * k + j] < 0) continue;
        expert_ffn(layer[ids[t * k + j]], x.data() + t * d, 1, hidden_gate.data(), hidden_up.data(), token_out.data());
        const float w = routing[t * k + j];
        for (int64_t i = 0; i < d; ++i) y[i] += w * token_out[i];
      }
    }
  };

  if (!f.json) {
    std::printf("moe-layer: d %lld, I %lld, E %lld, k %d, BF16 experts, %d layers cycled (%.1f GB, generated in "
                "%.1f s), %d threads, router skew %.2f, capacity factor %.2f\n",
                static_cast<long long>(d), static_cast<long long>(I), static_cast<long long>(E), k, f.layers,
                weight_bytes / 1e9, gen_seconds, num_threads(), f.router_skew, f.capacity_factor);
    std::printf("%5s %12s %12s %8s  %6s %6s %5s  %s\n", "T", "batched_ms", "per_token_ms", "speedup", "max/mn",
                "drops", "runs", "tokens per expert");
  }
  nlohmann::json rows = nlohmann::json::array();
  const TimingOptions timing{.repeats = f.repeats, .budget_s = f.budget_s};
  for (int T : f.tokens) {
    const Timing batched_timing = measure_median(timing, [&] { batched_layer(T); });
    const double batched = batched_timing.seconds;
    const int batched_runs = batched_timing.samples;
    const MoELoadStats stats = batcher.stats();
    // Same kernels per row and the same combine order: the two must agree (bitwise, in practice). Checked
    // on the first tokens of the last batched step, with its layer.
    const int64_t checked = std::min<int64_t>(T, 4);
    per_token_loop(T, checked, last_layer);
    double max_diff = 0.0;
    for (size_t i = 0; i < static_cast<size_t>(checked) * d; ++i)
      max_diff = std::max(max_diff, static_cast<double>(std::fabs(out_batched[i] - out_loop[i])));
    const Timing loop_timing = measure_median(timing, [&] { per_token_loop(T, T, -1); });
    const double loop = loop_timing.seconds;
    const int loop_runs = loop_timing.samples;
    std::string load;
    for (int c : stats.tokens_per_expert) load += (load.empty() ? "" : ",") + std::to_string(c);
    if (f.json) {
      rows.push_back({{"tokens", T}, {"batched_ms", batched * 1e3}, {"per_token_ms", loop * 1e3},
                      {"speedup", loop / batched}, {"tokens_per_expert", stats.tokens_per_expert},
                      {"drops_per_expert", stats.drops_per_expert}, {"max_over_mean", stats.max_over_mean()},
                      {"drops", stats.drops}, {"capacity", stats.capacity}, {"batched_runs", batched_runs},
                      {"per_token_runs", loop_runs}, {"max_abs_diff", max_diff}});
    } else {
      std::printf("%5d %12.2f %12.2f %7.2fx  %6.2f %6lld %2d/%-2d  [%s]%s\n", T, batched * 1e3, loop * 1e3,
                  loop / batched, stats.max_over_mean(), static_cast<long long>(stats.drops), batched_runs, loop_runs,
                  load.c_str(), max_diff > 1e-5 ? "  MISMATCH vs per-token loop" : "");
    }
  }
  if (f.json) {
    std::printf("%s\n", nlohmann::json{{"hidden", d}, {"intermediate", I}, {"experts", E}, {"top_k", k},
                                       {"layers", f.layers}, {"weight_gb", weight_bytes / 1e9},
                                       {"threads", num_threads()}, {"router_skew", f.router_skew},
                                       {"target_share", calibration.target_share}, {"capacity_factor", f.capacity_factor},
                                       {"results", rows}}.dump().c_str());
  } else {
    std::printf("ms per layer step, median of the runs shown (batched/per-token); per_token: each token runs its k "
                "experts one by one. Goal: speedup >= 4x at T=64.\n");
  }
}

void setup_moe_layer_bench(CLI::App& bench) {
  auto flags = std::make_shared<MoELayerFlags>();
  auto* cmd = bench.add_subcommand("moe-layer", "Whole MoE layer: dynamic batching against a per-token loop");
  flags->MoEShapeFlags::add_to(cmd, "Layers of expert weights cycled (keep them far above the L3 cache)");
  cmd->add_option("--intermediate", flags->intermediate, "Expert FFN dimension I")->capture_default_str();
  cmd->add_option("--router-skew", flags->router_skew, "Zipf exponent of expert popularity (0: balanced)")
      ->capture_default_str();
  cmd->add_option("--capacity-factor", flags->capacity_factor, "Expert capacity factor; <= 0 is dropless")
      ->capture_default_str();
  cmd->add_option("--repeats", flags->repeats, "Runs per cell after the warm-up (median reported)")
      ->capture_default_str();
  cmd->add_option("--budget-s", flags->budget_s, "Stop repeating a cell after this many seconds")
      ->capture_default_str();
  flags->threads.add_to(cmd);
  cmd->add_flag("--json", flags->json, "Machine-readable output");
  cmd->callback([flags] { run_moe_layer(*flags); });
}
MOEX_REGISTER_BENCH(setup_moe_layer_bench);

}  // namespace
}  // namespace moex::tools
