// `moex bench <name>`: end-to-end benchmarks, one file each, registered like the subcommands.
// Every benchmark measures against a reference taken in the same run and prints medians; --json for machines.
#pragma once
#include <chrono>
#include <functional>
#include <limits>
#include <vector>

#include "tools/moex/command.h"
#include "tools/moex/flags.h"

namespace moex::tools {

using BenchSetup = void (*)(CLI::App& bench);
bool register_bench(BenchSetup setup);

// How a benchmark times one cell. Every benchmark times through measure_median, so "median of N" means
// the same everywhere: one warm-up first (timed, never in the median), then up to `repeats` samples.
struct TimingOptions {
  int repeats = 5;  // samples; the median is reported
  // Stop sampling once the warm-up and the samples so far plus one more warm-up's length would pass this;
  // a cell whose warm-up alone spends it reports the warm-up (samples = 1).
  double budget_s = std::numeric_limits<double>::infinity();
  // > 0: the warm-up repeats fn() until it lasts this long, and every sample runs that many calls (calls
  // too short for the clock to time one by one); the result is per call.
  double sample_ms = 0;
  // Time samples on the calling thread's CPU clock: immune to other processes' load, so only meaningful
  // single-threaded (--threads 1); for checking kernels on a busy shared machine.
  bool cpu_clock = false;
};

struct Timing {
  double seconds = 0;  // median seconds per call of fn()
  int samples = 0;     // samples the median is over
};

Timing measure_median(const TimingOptions& options, const std::function<void()>& fn);
// The same warm-up, samples and budget, but each sample is the seconds fn() reports: the time of a part of what
// it runs (generate()'s decode loop without its prompts). sample_ms and cpu_clock do not apply.
Timing measure_median_reported(const TimingOptions& options, const std::function<double()>& fn);

// The shape flags of the benches that route tokens through MoE layers (router, moe-layer): the token
// counts T of the cells and the layer's geometry, Mixtral 8x7B's by default.
struct MoEShapeFlags {
  std::vector<int> tokens;
  int hidden = 4096;
  int experts = 8;
  int top_k = 2;
  int layers;  // cycled step by step, so weights come from where they would in a model, not a hot cache

  MoEShapeFlags(std::vector<int> default_tokens, int default_layers)
      : tokens(std::move(default_tokens)), layers(default_layers) {}
  void add_to(CLI::App* cmd, const std::string& layers_help);
  // Refuses a geometry no layer has (one line naming the flags).
  void check() const;
  int max_tokens() const;
};

}  // namespace moex::tools

#define MOEX_REGISTER_BENCH(setup) \
  [[maybe_unused]] static const bool moex_bench_registered_##setup = ::moex::tools::register_bench(setup)
