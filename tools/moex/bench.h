// `moex bench <name>`: end-to-end benchmarks, one file each, registered like the subcommands.
// Every benchmark measures against a reference taken in the same run and prints medians; --json for machines.
#pragma once
#include <chrono>
#include <functional>
#include <vector>

#include "tools/moex/command.h"

namespace moex::tools {

using BenchSetup = void (*)(CLI::App& bench);
bool register_bench(BenchSetup setup);

// Median of `repeats` timings (seconds) of fn(), after one warm-up call.
double median_seconds(int repeats, const std::function<void()>& fn);

}  // namespace moex::tools

#define MOEX_REGISTER_BENCH(setup) \
  [[maybe_unused]] static const bool moex_bench_registered_##setup = ::moex::tools::register_bench(setup)
