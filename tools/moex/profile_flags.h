// Flags every command that runs the model can offer: --profile, --trace FILE, --profile-json FILE.
// The command calls start() before its run, after_warmup() once its warm-up is done (if it has one),
// and finish() at the end: rank 0 prints the breakdown table (one per rank plus mean and slowest rank
// under mpirun) and writes the JSON report and the merged Chrome trace (one process per rank).
//
// Usage in a command:
//   ProfileFlags profile;  profile.add_to(cmd);
//   profile.start();  ... warm-up ...  profile.after_warmup();  ... run ...  profile.finish();
#pragma once
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "moex/profile/report.h"

namespace moex::tools {

struct ProfileFlags {
  bool table = false;     // --profile: print the breakdown table after the run
  std::string trace;      // --trace FILE: Chrome trace-event JSON (ui.perfetto.dev)
  std::string json_path;  // --profile-json FILE: the report as JSON ("-" for stdout)
  bool record = false;    // profile even without an output flag (the caller uses what finish() returns)

  void add_to(CLI::App* cmd);
  bool active() const { return record || table || !trace.empty() || !json_path.empty(); }

  // If active: sets the profiler's rank from the comm world, routes collective events into the
  // profiler, and enables it. Call on the thread that runs the steps.
  void start() const;
  // Forgets everything recorded so far (the warm-up). No-op when not active.
  void after_warmup() const;
  // Stops recording, gathers every rank's report (and trace) on rank 0 and prints/writes them there.
  // Collective under mpirun: every rank must call it. `out` gets the table (stderr when the command's
  // stdout is machine-readable). `expert_detail` adds the per-layer tokens-per-expert table.
  // Returns the report as JSON on rank 0 (rank_reports_to_json under mpirun); null elsewhere or when off.
  nlohmann::json finish(std::FILE* out = stdout, bool expert_detail = false) const;
};


// The reports of every rank on rank 0 (rank order); an empty vector on the other ranks. Collective.
std::vector<profile::Report> gather_reports(const profile::Report& mine);

}  // namespace moex::tools
