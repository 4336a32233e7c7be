#include "tools/moex/profile_flags.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdarg>
#include <cstring>
#include <numeric>

#include "moex/base/error.h"
#include "moex/comm/communicator.h"
#include "moex/comm/types.h"
#include "moex/profile/profile.h"
#include "moex/profile/trace.h"
#include "tools/moex/flags.h"

namespace moex::tools {
namespace {

// Point-to-point tags of the gather below; it runs after the measured work, when no other traffic is pending.
constexpr int kSizeTag = 0x7e01;
constexpr int kBytesTag = 0x7e02;

bool g_installed_observer = false;  // start() routed comm events into the profiler: finish() removes it

profile::Zone zone_of(comm::Collective collective) {
  switch (collective) {
    case comm::Collective::kAllreduce:
      return profile::Zone::kAllReduce;
    case comm::Collective::kAlltoall:
      return profile::Zone::kAllToAll;
    case comm::Collective::kAllgather:
      return profile::Zone::kAllGather;
    case comm::Collective::kReduceScatter:
      return profile::Zone::kReduceScatter;
    case comm::Collective::kBroadcast:
      return profile::Zone::kBroadcast;
  }
  return profile::Zone::kOther;
}

// Every rank's bytes on rank 0, in rank order; an empty vector elsewhere. Plain sends to rank 0 (a gather
// of sizes, then of payloads), so a size-1 world without mpirun never touches MPI.
std::vector<std::vector<uint8_t>> gather_bytes(std::vector<uint8_t> mine) {
  comm::Communicator& world = comm::world();
  const int size = world.size(), rank = world.rank();
  if (size == 1) return {std::move(mine)};
  uint64_t my_size = mine.size();
  if (rank != 0) {
    std::array<comm::P2PRequest, 2> sends = {world.isend(&my_size, sizeof my_size, 0, kSizeTag),
                                             world.isend(mine.data(), mine.size(), 0, kBytesTag)};
    world.wait_all(sends);
    return {};
  }
  std::vector<uint64_t> sizes(size, 0);
  std::vector<comm::P2PRequest> requests;
  for (int r = 1; r < size; ++r) requests.push_back(world.irecv(&sizes[r], sizeof(uint64_t), r, kSizeTag));
  world.wait_all(requests);
  std::vector<std::vector<uint8_t>> all(size);
  all[0] = std::move(mine);
  requests.clear();
  for (int r = 1; r < size; ++r) {
    all[r].resize(sizes[r]);
    requests.push_back(world.irecv(all[r].data(), sizes[r], r, kBytesTag));
  }
  world.wait_all(requests);
  return all;
}

void write_text(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::fputs(text.c_str(), stdout);
    std::fflush(stdout);
    return;
  }
  std::FILE* file = std::fopen(path.c_str(), "wb");
  MOEX_CHECK_INPUT(file != nullptr, "cannot write ", path, ": ", std::strerror(errno));
  const bool written = std::fwrite(text.data(), 1, text.size(), file) == text.size();
  MOEX_CHECK_INPUT(std::fclose(file) == 0 && written, "cannot write ", path, ": ", std::strerror(errno));
}

}  // namespace

void ProfileFlags::add_to(CLI::App* cmd) {
  cmd->add_flag("--profile", table, "Print where the time went (zones per phase) after the run");
  add_output_flag(cmd, "--trace", trace, "Write a Chrome trace (JSON; open in ui.perfetto.dev) to this file");
  add_output_flag(cmd, "--profile-json", json_path, "Write the profile report as JSON to this file ('-': stdout)");
}

void ProfileFlags::start() const {
  if (!active()) return;
  comm::Communicator& world = comm::world();
  profile::set_rank(world.rank(), world.size());
  if (!comm::has_event_observer()) {
    comm::set_event_observer([](const comm::CollectiveEvent& e) {
      const profile::Zone zone = zone_of(e.collective);
      profile::add_comm_bytes(zone, e.bytes_sent, e.bytes_received);
      const std::string algorithm(e.algorithm);  // record_comm_event wants a NUL-terminated name
      profile::record_comm_event(zone, algorithm.c_str(), e.bytes_in, e.start_ns, e.end_ns, e.wait_ns);
    });
    g_installed_observer = true;
  }
  profile::reset();
  profile::enable(true);
}

void ProfileFlags::after_warmup() const {
  if (active()) profile::reset();
}

std::vector<profile::Report> gather_reports(const profile::Report& mine) {
  std::vector<profile::Report> reports;
  for (const auto& bytes : gather_bytes(profile::report_to_bytes(mine))) reports.push_back(profile::report_from_bytes(bytes));
  return reports;
}

nlohmann::json ProfileFlags::finish(std::FILE* out, bool expert_detail) const {
  if (!active()) return nullptr;
  profile::enable(false);
  if (g_installed_observer) {
    comm::set_event_observer({});
    g_installed_observer = false;
  }
  const std::vector<profile::Report> reports = gather_reports(profile::collect());
  std::vector<profile::RankTrace> traces;
  if (!trace.empty()) {
    for (const auto& bytes : gather_bytes(profile::trace_to_bytes(profile::collect_trace())))
      traces.push_back(profile::trace_from_bytes(bytes));
  }
  if (reports.empty()) return nullptr;  // not rank 0

  if (table) {
    std::string text = reports.size() == 1 ? profile::format_table(reports[0]) : profile::format_rank_tables(reports);
    if (expert_detail) {
      for (const profile::Report& r : reports) {
        if (reports.size() > 1) text += "\n== rank " + std::to_string(r.rank) + ": expert load ==";
        text += "\n" + profile::format_expert_load(r);
      }
    }
#ifdef MOEX_PROFILE_ZONES_OFF
    text += "(built with MOEX_PROFILE_ZONES=OFF: zones are compiled out, only steps and counters are recorded)\n";
#endif
    std::fputs(text.c_str(), out);
    std::fflush(out);
  }
  nlohmann::json json =
      reports.size() == 1 ? profile::report_to_json(reports[0]) : profile::rank_reports_to_json(reports);
  if (!json_path.empty()) write_text(json_path, json.dump() + "\n");
  if (!trace.empty()) {
    profile::write_chrome_trace(trace, traces);
    std::fprintf(stderr, "trace: %s (%zu rank%s; open in ui.perfetto.dev)\n", trace.c_str(), traces.size(),
                 traces.size() == 1 ? "" : "s");
  }
  return json;
}

}  // namespace moex::tools
