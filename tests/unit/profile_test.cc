#include <gtest/gtest.h>
#include <omp.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/profile/profile.h"
#include "moex/profile/report.h"
#include "moex/profile/trace.h"

namespace moex::profile {
namespace {

void spin_for(int64_t ns) {
  const int64_t until = now_ns() + ns;
  while (now_ns() < until) {
  }
}

class Profile : public ::testing::Test {
 protected:
  void SetUp() override {
    reset();
    set_rank(0, 1);
    set_phase(Phase::kPrefill);
    enable(true);
  }
  void TearDown() override {
    enable(false);
    reset();
  }
};

// One prefill and two decode steps of a two-layer model, with nested zones and collectives.
void record_small_run() {
  {
    ScopedStep step(Phase::kPrefill, 16);
    MOEX_ZONE(kEmbedding);
    spin_for(20'000);
  }
  for (int s = 0; s < 2; ++s) {
    ScopedStep step(Phase::kDecode, 1);
    for (int layer = 0; layer < 2; ++layer) {
      {
        MOEX_ZONE_LAYER(kAttention, layer);
        spin_for(10'000);
        MOEX_ZONE_LAYER(kAllReduce, layer);
        const int64_t begin = now_ns();
        spin_for(5'000);
        record_comm_event(Zone::kAllReduce, "ring", 4096, begin, now_ns(), 1'000);
        add_comm_bytes(Zone::kAllReduce, 6144, 6144);
      }
      MOEX_ZONE_LAYER(kExperts, layer);
      spin_for(10'000);
      const int counts[4] = {1, 0, 1, 0};
      add_tokens_per_expert(layer, counts, 4);
    }
    spin_for(5'000);  // outside every zone: "other"
  }
}

// Pairs every B with its E on the same (pid, tid) and returns the slices as {begin, end, depth}.
struct ParsedSlice {
  double begin, end;
  int depth;
  std::string name;
};
std::map<std::pair<int, int>, std::vector<ParsedSlice>> parse_tracks(const nlohmann::json& trace) {
  std::map<std::pair<int, int>, std::vector<ParsedSlice>> tracks;
  std::map<std::pair<int, int>, std::vector<size_t>> open;
  std::map<std::pair<int, int>, double> last_ts;
  for (const auto& event : trace.at("traceEvents")) {
    const std::string ph = event.at("ph");
    if (ph != "B" && ph != "E") continue;
    const std::pair<int, int> track{event.at("pid").get<int>(), event.at("tid").get<int>()};
    const double ts = event.at("ts").get<double>();
    EXPECT_GE(ts, last_ts[track]) << "timestamps go back on a track";
    last_ts[track] = ts;
    auto& stack = open[track];
    if (ph == "B") {
      stack.push_back(tracks[track].size());
      tracks[track].push_back({ts, -1, static_cast<int>(stack.size()) - 1, event.at("name")});
    } else {
      EXPECT_FALSE(stack.empty()) << "an E without its B";
      if (stack.empty()) continue;
      tracks[track][stack.back()].end = ts;
      stack.pop_back();
    }
  }
  for (const auto& [track, stack] : open) EXPECT_TRUE(stack.empty()) << "a B without its E";
  return tracks;
}

TEST_F(Profile, TraceParsesAndEveryBeginHasItsEndInsideItsParent) {
  record_small_run();
  const std::string path = (std::filesystem::temp_directory_path() / "moex_profile_test_trace.json").string();
  write_chrome_trace(path);
  std::ifstream file(path);
  const nlohmann::json trace = nlohmann::json::parse(file);  // throws if not JSON
  std::filesystem::remove(path);

  const auto tracks = parse_tracks(trace);
  ASSERT_EQ(tracks.size(), 1u);
  const auto& slices = tracks.begin()->second;
  ASSERT_EQ(slices.size(), 1u + 2 * 2 * 4);  // embedding; per decode layer attention, all_reduce, ring, experts
  std::vector<const ParsedSlice*> parents;
  for (const ParsedSlice& s : slices) {
    EXPECT_LE(s.begin, s.end) << s.name;
    parents.resize(s.depth);
    if (s.depth > 0) {
      EXPECT_GE(s.begin, parents.back()->begin) << s.name << " begins before its parent " << parents.back()->name;
      EXPECT_LE(s.end, parents.back()->end) << s.name << " ends after its parent " << parents.back()->name;
    }
    parents.push_back(&s);
  }
  EXPECT_EQ(slices[1].name, "attention");
  EXPECT_EQ(slices[2].name, "all_reduce");
  EXPECT_EQ(slices[3].name, "all_reduce (ring)");
  EXPECT_EQ(slices[3].depth, 2);

  int steps = 0, comm = 0;
  for (const auto& event : trace.at("traceEvents")) {
    if (event.value("cat", "") == "step") ++steps;
    if (event.value("cat", "") == "comm") {
      ++comm;
      EXPECT_EQ(event.at("args").at("algorithm"), "ring");
      EXPECT_EQ(event.at("args").at("bytes"), 4096);
      EXPECT_NEAR(event.at("args").at("wait_us").get<double>(), 1.0, 1e-9);
    }
  }
  EXPECT_EQ(steps, 3);
  EXPECT_EQ(comm, 4);
}

TEST_F(Profile, NestedTimeCountsOnceAsSelfTime) {
  {
    ScopedStep step(Phase::kDecode, 1);
    MOEX_ZONE(kAttention);
    spin_for(20'000);
    MOEX_ZONE(kAllReduce);
    spin_for(20'000);
  }
  const RankTrace trace = collect_trace();
  ASSERT_EQ(trace.threads.size(), 1u);
  const auto& slices = trace.threads[0].slices;
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(slices[0].zone, Zone::kAttention);
  EXPECT_EQ(slices[1].depth, 1);
  EXPECT_GE(slices[1].begin_ns, slices[0].begin_ns);
  EXPECT_LE(slices[1].end_ns, slices[0].end_ns);

  const PhaseReport decode = collect().phase(Phase::kDecode);
  const ZoneTime& attention = decode.zone(Zone::kAttention);
  const ZoneTime& all_reduce = decode.zone(Zone::kAllReduce);
  EXPECT_EQ(attention.total_ns, attention.self_ns + all_reduce.total_ns);
  EXPECT_EQ(all_reduce.self_ns, all_reduce.total_ns);
  EXPECT_GE(all_reduce.self_ns, 20'000);
  EXPECT_GE(attention.self_ns, 20'000);
}

TEST_F(Profile, SharesAddUpTo100AndOtherIsNeverNegative) {
  record_small_run();
  const Report report = collect();
  for (Phase phase : {Phase::kPrefill, Phase::kDecode}) {
    const PhaseReport& p = report.phase(phase);
    double sum = p.unzoned_share();
    for (int z = 0; z < kNumZones; ++z) sum += p.share(static_cast<Zone>(z));
    EXPECT_NEAR(sum, 1.0, 1e-12) << phase_name(phase);
    EXPECT_GE(p.unzoned_ns(), 0);
    EXPECT_EQ(p.step_ns(), p.wall_ns);  // the steps enclose every zone here
  }
  const PhaseReport& decode = report.phase(Phase::kDecode);
  EXPECT_EQ(decode.steps, 2);
  EXPECT_EQ(decode.tokens, 2);
  EXPECT_GE(decode.unzoned_ns(), 2 * 5'000);
  EXPECT_EQ(decode.zone(Zone::kAttention).calls, 4);
  EXPECT_EQ(decode.zone(Zone::kAllReduce).calls, 4);  // the ring event annotates the open all_reduce zone
  EXPECT_EQ(decode.zone(Zone::kAttention).layers, 2);
  EXPECT_NEAR(decode.us_per_layer(Zone::kExperts), decode.zone(Zone::kExperts).self_ns * 1e-3 / 2 / 2, 1e-9);
  EXPECT_EQ(decode.comm[static_cast<int>(Zone::kAllReduce)].events, 4);
  EXPECT_EQ(decode.comm[static_cast<int>(Zone::kAllReduce)].wait_ns, 4'000);
  EXPECT_EQ(decode.comm[static_cast<int>(Zone::kAllReduce)].bytes_sent, 4u * 6144);
  EXPECT_EQ(decode.tokens_per_expert, (std::vector<std::vector<uint64_t>>{{2, 0, 2, 0}, {2, 0, 2, 0}}));

  // The printed shares, rounded to 0.1%, add up to the printed 100.0% within rounding.
  const std::string table = format_table(report);
  const std::regex row(R"(\n  ([a-z_]+) +[0-9.]+ +([0-9.]+)%)");
  double printed_decode = 0;
  int rows = 0;
  const std::string decode_part = table.substr(table.find("decode:"));
  for (auto it = std::sregex_iterator(decode_part.begin(), decode_part.end(), row); it != std::sregex_iterator(); ++it) {
    if ((*it)[1] == "total") {
      EXPECT_EQ((*it)[2], "100.0");
      continue;
    }
    printed_decode += std::stod((*it)[2]);
    ++rows;
  }
  EXPECT_EQ(rows, 4) << table;  // attention, all_reduce, experts, other
  EXPECT_NEAR(printed_decode, 100.0, 0.05 * rows) << table;
}

TEST_F(Profile, WallShorterThanZonesLeavesNoNegativeOther) {
  {
    MOEX_ZONE(kRouter);
    spin_for(10'000);
  }
  mark_step(Phase::kPrefill, 1'000, 1);  // a caller that timed less than its zones
  const PhaseReport p = collect().phase(Phase::kPrefill);
  EXPECT_EQ(p.unzoned_ns(), 0);
  EXPECT_EQ(p.step_ns(), p.zoned_ns());
  EXPECT_DOUBLE_EQ(p.share(Zone::kRouter), 1.0);
}

TEST_F(Profile, CollectiveOutsideItsZoneBecomesAZone) {
  {
    ScopedStep step(Phase::kDecode, 1);
    MOEX_ZONE(kExperts);
    const int64_t begin = now_ns();
    spin_for(10'000);
    record_comm_event(Zone::kAllToAll, "pairwise", 100, begin, now_ns(), 0);
  }
  const PhaseReport p = collect().phase(Phase::kDecode);
  const ZoneTime& all_to_all = p.zone(Zone::kAllToAll);
  EXPECT_EQ(all_to_all.calls, 1);
  EXPECT_GE(all_to_all.self_ns, 10'000);
  EXPECT_EQ(p.zone(Zone::kExperts).total_ns, p.zone(Zone::kExperts).self_ns + all_to_all.total_ns);
  EXPECT_EQ(p.comm[static_cast<int>(Zone::kAllToAll)].transfer_ns, all_to_all.total_ns);
}

TEST_F(Profile, DisabledRecordsNothing) {
  enable(false);
  {
    ScopedStep step(Phase::kDecode, 1);
    MOEX_ZONE(kRouter);
    add_comm_bytes(Zone::kAllReduce, 1, 1);
    record_comm_event(Zone::kAllReduce, "ring", 1, 0, 1, 0);
  }
  const Report report = collect();
  EXPECT_TRUE(report.phase(Phase::kPrefill).empty());
  EXPECT_TRUE(report.phase(Phase::kDecode).empty());
  for (const ThreadTrace& thread : collect_trace().threads) EXPECT_TRUE(thread.slices.empty());
}

TEST_F(Profile, ZonesOnOtherThreadsLandOnTheirOwnTracks) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([] {
      MOEX_ZONE(kExperts);
      spin_for(10'000);
    });
  }
  for (std::thread& thread : threads) thread.join();
  int team_size = 1;
#pragma omp parallel num_threads(2)
  {
    MOEX_ZONE(kCombine);
    spin_for(5'000);
#pragma omp single
    team_size = omp_get_num_threads();
  }
  {
    ScopedStep step(Phase::kDecode, 1);
    MOEX_ZONE(kRouter);
    spin_for(5'000);
  }

  const RankTrace trace = collect_trace();
  std::set<int> experts_threads, all_threads;
  for (const ThreadTrace& thread : trace.threads) {
    all_threads.insert(thread.thread);
    for (const TraceSlice& slice : thread.slices) {
      if (slice.zone == Zone::kExperts) experts_threads.insert(thread.thread);
    }
  }
  EXPECT_EQ(experts_threads.size(), 3u);
  EXPECT_EQ(all_threads.size(), trace.threads.size());

  const auto tracks = parse_tracks(nlohmann::json::parse(chrome_trace_json(std::span<const RankTrace>(&trace, 1))));
  EXPECT_GE(tracks.size(), 4u);  // three std::threads and this one, at least

  // This thread marks the steps, so the other threads' zones stay out of the shares.
  const PhaseReport decode = collect().phase(Phase::kDecode);
  EXPECT_EQ(decode.zone(Zone::kRouter).calls, 1);
  EXPECT_EQ(decode.zone(Zone::kExperts).calls, 0);
  EXPECT_EQ(decode.worker_zones[static_cast<int>(Zone::kExperts)].calls, 0);  // recorded in prefill
  const PhaseReport prefill = collect().phase(Phase::kPrefill);
  EXPECT_EQ(prefill.worker_zones[static_cast<int>(Zone::kExperts)].calls, 3);
  const int combine_on_workers = static_cast<int>(prefill.worker_zones[static_cast<int>(Zone::kCombine)].calls);
  const int combine_here = static_cast<int>(prefill.zone(Zone::kCombine).calls);
  EXPECT_EQ(combine_here, 1);  // OpenMP's master is this thread
  EXPECT_EQ(combine_on_workers, team_size - 1);
}

TEST_F(Profile, ReportRoundTripsThroughBytesAndJson) {
  record_small_run();
  const Report report = collect();
  const nlohmann::json json = report_to_json(report);
  EXPECT_EQ(report_to_json(report_from_bytes(report_to_bytes(report))), json);
  EXPECT_EQ(report_to_json(report_from_json(nlohmann::json::parse(json.dump()))), json);
  EXPECT_THROW(report_from_bytes(std::vector<uint8_t>{1, 2, 3}), Error);
}

TEST_F(Profile, TracesOfSeveralRanksMergeIntoOneProcessPerRank) {
  record_small_run();
  std::vector<RankTrace> ranks;
  for (int r = 0; r < 3; ++r) {
    RankTrace trace = trace_from_bytes(trace_to_bytes(collect_trace()));
    trace.rank = r;
    ranks.push_back(std::move(trace));
  }
  const RankTrace original = collect_trace();
  ASSERT_EQ(ranks[0].threads.size(), original.threads.size());
  EXPECT_EQ(ranks[0].threads[0].slices.size(), original.threads[0].slices.size());
  EXPECT_EQ(ranks[0].threads[0].comm[0].algorithm, "ring");
  EXPECT_EQ(ranks[0].steps.size(), 3u);

  const nlohmann::json merged = nlohmann::json::parse(chrome_trace_json(ranks));
  std::set<int> pids;
  std::map<int, std::string> process_names;
  for (const auto& event : merged.at("traceEvents")) {
    pids.insert(event.at("pid").get<int>());
    if (event.value("name", "") == "process_name") process_names[event.at("pid")] = event.at("args").at("name");
  }
  EXPECT_EQ(pids, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(process_names[2], "rank 2");
  EXPECT_EQ(parse_tracks(merged).size(), 3u);
}

PhaseReport synthetic_phase(int64_t wall_ms, int64_t router_ms, int64_t experts_ms) {
  PhaseReport p;
  p.steps = 10;
  p.tokens = 10;
  p.wall_ns = wall_ms * 1'000'000;
  p.zones[static_cast<int>(Zone::kRouter)] = {router_ms * 1'000'000, router_ms * 1'000'000, 10, 0, 0};
  p.zones[static_cast<int>(Zone::kExperts)] = {experts_ms * 1'000'000, experts_ms * 1'000'000, 10, 0, 0};
  return p;
}

// drain_thread_totals: the same self times collect() reports, summed over phases, then zero; and the buffer
// it drained keeps no trace slices, so a loop that drains every step does not grow.
TEST_F(Profile, DrainThreadTotalsSumsPhasesAndEmptiesTheBuffer) {
  record_small_run();
  const int counts0[3] = {4, 0, 2}, counts1[2] = {1, 5};
  add_tokens_per_expert(0, counts0, 3);
  set_phase(Phase::kDecode);
  add_tokens_per_expert(1, counts1, 2);
  add_tokens_per_expert(0, counts0, 3);
  const Report before = collect();
  ThreadTotals totals;
  drain_thread_totals(totals);
  for (int z = 0; z < kNumZones; ++z)
    EXPECT_EQ(totals.self_ns[z], before.phase(Phase::kPrefill).zones[z].self_ns + before.phase(Phase::kDecode).zones[z].self_ns)
        << zone_name(static_cast<Zone>(z));
  EXPECT_GT(totals.self_ns[static_cast<int>(Zone::kAttention)], 0);
  ASSERT_EQ(totals.tokens_per_expert.size(), 2u);
  // record_small_run's two decode steps add {1, 0, 1, 0} to each of its two layers.
  EXPECT_EQ(totals.tokens_per_expert[0], (std::vector<uint64_t>{10, 0, 6, 0}));
  EXPECT_EQ(totals.tokens_per_expert[1], (std::vector<uint64_t>{3, 5, 2, 0}));
  const RankTrace trace = collect_trace();
  EXPECT_TRUE(trace.steps.empty());
  for (const ThreadTrace& t : trace.threads) EXPECT_TRUE(t.slices.empty());
  const Report after = collect();
  for (const PhaseReport& p : after.phases)
    for (const ZoneTime& z : p.zones) EXPECT_EQ(z.self_ns, 0);
  // A second drain adds nothing but what was recorded since.
  {
    MOEX_ZONE(kRouter);
    spin_for(10'000);
  }
  ThreadTotals again = totals;
  drain_thread_totals(again);
  EXPECT_EQ(again.self_ns[static_cast<int>(Zone::kAttention)], totals.self_ns[static_cast<int>(Zone::kAttention)]);
  EXPECT_GE(again.self_ns[static_cast<int>(Zone::kRouter)] - totals.self_ns[static_cast<int>(Zone::kRouter)], 10'000);
  EXPECT_EQ(again.tokens_per_expert, totals.tokens_per_expert);
}

TEST(ProfileRanks, MeanAndSlowestRank) {
  std::vector<Report> ranks(3);
  const int64_t walls[3] = {100, 130, 110}, routers[3] = {18, 20, 22}, experts[3] = {35, 70, 45};
  for (int r = 0; r < 3; ++r) {
    ranks[r].rank = r;
    ranks[r].world = 3;
    ranks[r].phases[static_cast<int>(Phase::kDecode)] = synthetic_phase(walls[r], routers[r], experts[r]);
  }
  ranks[2].phases[static_cast<int>(Phase::kPrefill)] = synthetic_phase(50, 5, 5);

  EXPECT_EQ(slowest_rank(ranks, Phase::kDecode), 1);
  EXPECT_EQ(slowest_rank(ranks, Phase::kPrefill), 2);
  const Report mean = mean_report(ranks);
  const PhaseReport& decode = mean.phase(Phase::kDecode);
  EXPECT_EQ(decode.wall_ns, 113'333'333);  // (100 + 130 + 110) / 3 ms, rounded to the ns
  EXPECT_EQ(decode.zone(Zone::kRouter).self_ns, 20'000'000);
  EXPECT_EQ(decode.zone(Zone::kExperts).self_ns, 50'000'000);
  EXPECT_EQ(decode.unzoned_ns(), 113'333'333 - 70'000'000);

  const std::string tables = format_rank_tables(ranks);
  EXPECT_NE(tables.find("== rank 2 of 3 =="), std::string::npos) << tables;
  EXPECT_NE(tables.find("== mean of 3 ranks =="), std::string::npos) << tables;
  EXPECT_NE(tables.find("slowest rank: 1 (130.000 ms, +14.7% over the mean)"), std::string::npos) << tables;
  EXPECT_NE(tables.find("slowest rank: 2 (50.000 ms, +200.0% over the mean)"), std::string::npos) << tables;
  // The comparison row: each rank, then the mean and the max.
  EXPECT_NE(tables.find("experts             35.000    70.000    45.000    50.000    70.000"), std::string::npos)
      << tables;

  const nlohmann::json json = rank_reports_to_json(ranks);
  EXPECT_EQ(json.at("slowest_rank").at("decode"), 1);
  EXPECT_EQ(json.at("ranks").size(), 3u);
}

}  // namespace
}  // namespace moex::profile
