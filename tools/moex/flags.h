// The flag groups commands share, so that a flag means the same and is checked the same in every command
// that takes it: ThreadsFlags (--threads), CommFlags (the collectives' algorithms and tuning table),
// ParallelFlags (the plan over ranks) and, built from them, ModelFlags (model_flags.h). A command holds a
// group as a member (or derives from it), calls add_to(cmd) in its setup and apply() before computing.
// Lists of values are CLI11 options with add_list_flag's delimiter, parsed one way for every command.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "moex/comm/communicator.h"
#include "moex/moe/parallel_plan.h"

namespace moex::tools {

struct ThreadsFlags {
  int threads = 0;  // 0: MOEX_THREADS, else all cores

  void add_to(CLI::App* cmd);
  // set_num_threads: refuses a count outside 0..max (and a bad MOEX_THREADS / MOEX_ISA) with one line.
  void apply() const;
};

struct CommFlags {
  std::string allreduce_algo, alltoall_algo, comm_tuning;

  void add_to(CLI::App* cmd);
  // Installs the options every communicator uses (a bad name or table is one error, exit 2).
  void apply() const;
  // The world communicator, after apply().
  comm::Communicator& world() const;
};

// The activations' dtype between ranks, spelled as the comm library names it (comm_dtype_name: "f32",
// "bf16", "fp8"), which is also how tuning tables and `bench-comm --dtype` spell it: one spelling, no aliases.
inline const std::vector<std::string> kCommDTypeNames = {"f32", "bf16", "fp8"};

struct ParallelFlags {
  PlanRequest plan;

  void add_to(CLI::App* cmd);
};

// A seed flag: a whole number in 0..2^64-1. CLI11 alone would read -1 into the uint64_t as 2^64 - 1 and
// let 2^64 wrap to 0.
CLI::Option* add_seed_flag(CLI::App* cmd, uint64_t& seed, const std::string& help);

// A flag naming a file or folder to write (--out, --tokens-out, ...): an empty value is a usage error.
CLI::Option* add_output_flag(CLI::App* cmd, const std::string& name, std::string& path, const std::string& help);
// -q / --quiet: no progress line on the terminal (base/progress.h) in this run.
CLI::Option* add_quiet_flag(CLI::App* cmd);

// Each value (each item of a list) a whole number in lo..hi; the error names the item and the range (CLI11's
// own range checks print the bounds as doubles).
CLI::Validator whole_number_in(int64_t lo, int64_t hi);

// A comma-separated list flag ("1,16,64" or repeated flags) into `values`; `help` says what one item is.
template <class T>
CLI::Option* add_list_flag(CLI::App* cmd, const std::string& name, std::vector<T>& values, const std::string& help) {
  return cmd->add_option(name, values, help + ", comma-separated")->delimiter(',')->capture_default_str();
}

}  // namespace moex::tools
