#include "tools/moex/flags.h"

#include <charconv>
#include <limits>

#include "moex/base/progress.h"
#include "moex/base/threads.h"
#include "moex/comm/selector.h"

namespace moex::tools {

void ThreadsFlags::add_to(CLI::App* cmd) {
  cmd->add_option("--threads", threads, "Threads per rank (0: MOEX_THREADS, else all cores)")->capture_default_str();
}

void ThreadsFlags::apply() const { set_num_threads(threads); }

void CommFlags::add_to(CLI::App* cmd) {
  cmd->add_option("--allreduce-algo", allreduce_algo,
                  "Force the all-reduce: auto | ring | rd | rabenseifner | nhr | mesh | shm | mpi");
  cmd->add_option("--alltoall-algo", alltoall_algo, "Force the all-to-all: auto | pairwise | bruck | mpi");
  cmd->add_option("--comm-tuning", comm_tuning, "Tuning table from `moex tune-comm` (JSON) for auto; none: no table");
}

void CommFlags::apply() const {
  comm::set_comm_options(comm::comm_options_from_flags(allreduce_algo, alltoall_algo, comm_tuning));
}

comm::Communicator& CommFlags::world() const {
  apply();
  return comm::world();
}

CLI::Option* add_output_flag(CLI::App* cmd, const std::string& name, std::string& path, const std::string& help) {
  const CLI::Validator not_empty(
      [](std::string& text) { return text.empty() ? std::string("the path is empty") : std::string(); }, "PATH");
  return cmd->add_option(name, path, help)->check(not_empty);
}

CLI::Validator whole_number_in(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) {
        int64_t value = 0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        return error == std::errc() && end == text.data() + text.size() && value >= lo && value <= hi
                   ? std::string()
                   : "'" + text + "' is not a whole number in " + std::to_string(lo) + ".." + std::to_string(hi);
      },
      "INT");
}

CLI::Option* add_seed_flag(CLI::App* cmd, uint64_t& seed, const std::string& help) {
  const CLI::Validator whole_uint64(
      [](std::string& text) {
        uint64_t value = 0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        return error == std::errc() && end == text.data() + text.size()
                   ? std::string()
                   : "'" + text + "' is not a whole number in 0.." + std::to_string(std::numeric_limits<uint64_t>::max());
      },
      "UINT64");
  return cmd->add_option("--seed", seed, help)->capture_default_str()->check(whole_uint64);
}

void ParallelFlags::add_to(CLI::App* cmd) {
  cmd->add_option("--moe-parallel", plan.moe,
                  "MoE over ranks: auto | tp | ep | tpxep (auto: tp on one host; across hosts TP inside each host x EP "
                  "across them)")
      ->capture_default_str();
  cmd->add_option("--attn-parallel", plan.attn, "Attention over ranks: tp (heads) | dp (sequences)")
      ->capture_default_str();
  // 0 stands for "derived" inside PlanRequest, so a 0 the user typed must not reach it.
  cmd->add_option("--tp", plan.tp, "TP group size (tpxep; default derived)")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--ep", plan.ep, "EP group size (tpxep; default derived)")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--comm-dtype", plan.comm_dtype, "Activations between ranks: f32 | bf16 | fp8")
      ->capture_default_str()
      ->check(CLI::IsMember(kCommDTypeNames));
  cmd->add_flag("--overlap", plan.overlap, "Overlap the MoE all-reduce with the expert computation (chunked)");
}

CLI::Option* add_quiet_flag(CLI::App* cmd) {
  return cmd->add_flag_callback("-q,--quiet", [] { set_progress_quiet(true); },
                                "No progress line on the terminal (there is none when stderr is not a terminal)");
}

}  // namespace moex::tools
