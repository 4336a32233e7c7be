// ProfileFlags (tools/moex/profile_flags.cc) with the comm layer: collectives become profiler slices nested
// in the zone that ran them, and finish() gathers every rank's report and trace on rank 0. Runs as one
// process and under mpirun (ctest runs both).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/comm/communicator.h"
#include "moex/profile/profile.h"
#include "moex/profile/report.h"
#include "moex/profile/trace.h"
#include "tools/moex/profile_flags.h"

namespace moex::tools {
namespace {

void spin_for(int64_t ns) {
  const int64_t until = profile::now_ns() + ns;
  while (profile::now_ns() < until) {
  }
}

std::string temp_path(const char* name) {
  // Every rank passes the same path; only rank 0 writes.
  return (std::filesystem::temp_directory_path() / (std::string("moex_profile_it_") + name)).string();
}

// Every rank runs 2 decode steps, each an attention zone holding an all-reduce over the world (the same
// collectives in the same order on every rank); rank r then runs r more steps without one.
void run_steps() {
  const int rank = comm::world().rank();
  std::vector<float> data(64, 1.0f);
  for (int step = 0; step < 2 + rank; ++step) {
    profile::ScopedStep s(profile::Phase::kDecode, 1);
    MOEX_ZONE_LAYER(kAttention, 0);
    spin_for(20'000);
    if (step < 2) comm::world().allreduce(data.data(), data.size(), comm::CommDType::kF32);
    spin_for(20'000);
  }
}

TEST(ProfileFlags, CollectivesNestInTheirZoneAndRanksAreGathered) {
  comm::Communicator& world = comm::world();
  ProfileFlags flags;
  flags.trace = temp_path("trace.json");
  flags.json_path = temp_path("report.json");
  flags.start();
  // A warm-up that after_warmup() must forget.
  { profile::ScopedStep s(profile::Phase::kDecode, 1); MOEX_ZONE(kSampling); }
  flags.after_warmup();
  run_steps();
  const nlohmann::json returned = flags.finish(stdout);
  EXPECT_FALSE(profile::enabled());
  if (world.rank() != 0) {
    EXPECT_TRUE(returned.is_null());
    return;
  }
  const int size = world.size();

  // The report: one per rank, rank r with r + 2 steps; the all-reduce is its own row with its event.
  std::ifstream report_file(flags.json_path);
  const nlohmann::json report = nlohmann::json::parse(report_file);
  EXPECT_EQ(report, returned);
  const nlohmann::json per_rank = size == 1 ? nlohmann::json::array({report}) : report.at("ranks");
  ASSERT_EQ(static_cast<int>(per_rank.size()), size);
  for (int r = 0; r < size; ++r) {
    const nlohmann::json& decode = per_rank[r].at("phases").at("decode");
    EXPECT_EQ(per_rank[r].at("rank").get<int>(), r);
    EXPECT_EQ(decode.at("steps").get<int>(), r + 2) << "rank " << r;
    EXPECT_FALSE(decode.at("zones").contains("sampling")) << "the warm-up was not forgotten";
    EXPECT_EQ(decode.at("zones").at("attention").at("calls").get<int>(), r + 2);
    EXPECT_EQ(decode.at("zones").at("all_reduce").at("calls").get<int>(), 2);
    EXPECT_EQ(decode.at("comm").at("all_reduce").at("events").get<int>(), 2);
    double shares = decode.at("unzoned_share").get<double>();
    for (const auto& [name, zone] : decode.at("zones").items()) shares += zone.at("share").get<double>();
    EXPECT_NEAR(shares, 1.0, 1e-9);
  }
  if (size > 1) {
    const int slowest = report.at("slowest_rank").at("decode").get<int>();
    EXPECT_TRUE(slowest >= 0 && slowest < size) << slowest;
    EXPECT_EQ(report.at("mean").at("rank").get<int>(), -1);
  }

  // The trace: one process per rank; every all_reduce slice lies inside an attention slice on its track.
  std::ifstream trace_file(flags.trace);
  const nlohmann::json trace = nlohmann::json::parse(trace_file);
  std::map<std::pair<int, int>, std::vector<nlohmann::json>> open;
  std::map<int, int> nested_allreduces;
  for (const nlohmann::json& e : trace.at("traceEvents")) {
    const auto key = std::make_pair(e.at("pid").get<int>(), e.at("tid").get<int>());
    const std::string ph = e.at("ph");
    if (ph == "B") {
      open[key].push_back(e);
    } else if (ph == "E") {
      ASSERT_FALSE(open[key].empty());
      const nlohmann::json begin = open[key].back();
      open[key].pop_back();
      EXPECT_GE(e.at("ts").get<double>(), begin.at("ts").get<double>());
      if (begin.at("name").get<std::string>().rfind("all_reduce", 0) == 0) {
        ASSERT_FALSE(open[key].empty()) << "an all_reduce outside every zone";
        const nlohmann::json& parent = open[key].back();
        EXPECT_EQ(parent.at("name"), "attention");
        EXPECT_GE(begin.at("ts").get<double>(), parent.at("ts").get<double>());
        EXPECT_TRUE(begin.at("args").contains("algorithm"));
        EXPECT_EQ(begin.at("args").at("bytes").get<int>(), 64 * 4);
        ++nested_allreduces[key.first];
      }
    }
  }
  for (const auto& [key, stack] : open) EXPECT_TRUE(stack.empty()) << "unclosed slice on " << key.first;
  for (int r = 0; r < size; ++r) EXPECT_EQ(nested_allreduces[r], 2) << "rank " << r;
  std::filesystem::remove(flags.trace);
  std::filesystem::remove(flags.json_path);
}

TEST(ProfileFlags, InactiveFlagsRecordNothing) {
  ProfileFlags flags;
  flags.start();
  EXPECT_FALSE(profile::enabled());
  EXPECT_TRUE(flags.finish().is_null());
}

TEST(ProfileFlags, ExpertLoadTableShowsMaxOverMean) {
  profile::Report report;
  profile::PhaseReport& decode = report.phases[static_cast<int>(profile::Phase::kDecode)];
  decode.steps = 2;
  decode.tokens_per_expert = {{4, 0, 0, 0}, {1, 1, 1, 1}};  // 2 steps x batch 1 x k 2 = 4 per layer
  const std::string text = profile::format_expert_load(report);
  EXPECT_NE(text.find("decode expert load"), std::string::npos) << text;
  EXPECT_NE(text.find("4.00    4 0 0 0"), std::string::npos) << text;  // busiest = 4x the mean
  EXPECT_NE(text.find("1.00    1 1 1 1"), std::string::npos) << text;
}

}  // namespace
}  // namespace moex::tools
