#include "tools/moex/bench.h"

#include <time.h>

#include <algorithm>
#include <chrono>

namespace moex::tools {
namespace {

std::vector<BenchSetup>& bench_registry() {
  static std::vector<BenchSetup> benches;
  return benches;
}

void setup_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmarks: each measures against a reference in the same run");
  bench->require_subcommand(1);
  for (auto setup : bench_registry()) setup(*bench);
}
MOEX_REGISTER_COMMAND(setup_bench);

}  // namespace

bool register_bench(BenchSetup setup) {
  bench_registry().push_back(setup);
  return true;
}

namespace {

double thread_cpu_now() {
  timespec now;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

double wall_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

void MoEShapeFlags::add_to(CLI::App* cmd, const std::string& layers_help) {
  add_list_flag(cmd, "--tokens", tokens, "Token counts T")->check(whole_number_in(1, INT32_MAX));
  cmd->add_option("--hidden", hidden, "Model dimension d")->capture_default_str();
  cmd->add_option("--experts", experts, "Experts E")->capture_default_str();
  cmd->add_option("--top-k", top_k, "Experts per token k")->capture_default_str();
  cmd->add_option("--layers", layers, layers_help)->capture_default_str();
}

void MoEShapeFlags::check() const {
  MOEX_CHECK_INPUT(hidden > 1 && experts > 0 && top_k >= 1 && top_k <= experts && layers >= 1,
                   "--hidden must be > 1, --experts and --layers > 0, --top-k in 1..--experts");
}

int MoEShapeFlags::max_tokens() const { return tokens.empty() ? 1 : *std::max_element(tokens.begin(), tokens.end()); }

namespace {
double median(std::vector<double>& samples) {  // the middle sample (the upper one of an even count)
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}
}  // namespace

Timing measure_median(const TimingOptions& options, const std::function<void()>& fn) {
  // The warm-up pages in weights and sizes buffers; with sample_ms it also counts the calls per sample.
  const double warmup_start = wall_now();
  int calls = 0;
  do {
    fn();
    ++calls;
  } while (options.sample_ms > 0 && wall_now() - warmup_start < options.sample_ms * 1e-3);
  const double warmup = wall_now() - warmup_start;
  const int calls_per_sample = options.sample_ms > 0 ? calls : 1;
  const auto now = options.cpu_clock ? thread_cpu_now : wall_now;
  std::vector<double> samples;
  double spent = warmup;
  while (static_cast<int>(samples.size()) < std::max(options.repeats, 1) && spent + warmup < options.budget_s) {
    const double start = now();
    for (int i = 0; i < calls_per_sample; ++i) fn();
    samples.push_back(now() - start);
    spent += samples.back();
  }
  if (samples.empty()) samples.push_back(warmup);
  return {median(samples) / calls_per_sample, static_cast<int>(samples.size())};
}

Timing measure_median_reported(const TimingOptions& options, const std::function<double()>& fn) {
  const double start = wall_now();
  const double warmup_reported = fn();
  const double warmup = wall_now() - start;
  std::vector<double> samples;
  while (static_cast<int>(samples.size()) < std::max(options.repeats, 1) && wall_now() - start + warmup < options.budget_s)
    samples.push_back(fn());
  if (samples.empty()) samples.push_back(warmup_reported);
  return {median(samples), static_cast<int>(samples.size())};
}

}  // namespace moex::tools
