#include "tools/moex/bench.h"

#include <algorithm>

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

double median_seconds(int repeats, const std::function<void()>& fn) {
  fn();  // warm-up: page in weights, size buffers
  std::vector<double> times;
  for (int i = 0; i < std::max(repeats, 1); ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace moex::tools
