// Auto's online trial (comm::OnlineChoice): who runs each call, when the trial ends, what it keeps.
// The ranks' max step is played by a lambda here; tests/mpi runs the same class across ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "moex/base/error.h"
#include "moex/comm/online.h"
#include "moex/comm/selector.h"

namespace moex::comm {
namespace {

using A = AllreduceAlgo;
const OnlineChoice::Key kKey{1 << 20, CommDType::kF32, false};

// Runs a whole trial where candidate `algo` takes `seconds[algo]` on this rank; `others` is what the other
// ranks report (the max step takes it into account). Returns the calls handed out, in order.
std::vector<A> run_trial(OnlineChoice& online, const std::vector<A>& candidates, std::map<A, double> seconds,
                         std::map<A, double> others = {}) {
  std::vector<A> calls;
  std::vector<A> racing;  // who ran in the round that is going on, in order
  for (int i = 0; i < 100000; ++i) {
    bool timed = false;
    const A algo = online.next(kKey, candidates, &timed);
    if (!timed) break;
    calls.push_back(algo);
    if (racing.empty() || racing.back() != algo) racing.push_back(algo);
    if (online.record(kKey, seconds[algo])) {
      online.end_round(kKey, [&](std::span<double> values) {
        EXPECT_EQ(values.size(), racing.size());
        for (size_t c = 0; c < values.size(); ++c) values[c] = std::max(values[c], others[racing[c]]);
      });
      racing.clear();
    }
  }
  return calls;
}

A kept(OnlineChoice& online, const std::vector<A>& candidates) {
  bool timed = true;
  const A algo = online.next(kKey, candidates, &timed);
  EXPECT_FALSE(timed);
  return algo;
}

TEST(CommOnline, OneCandidateIsNeverATrial) {
  OnlineChoice online;
  bool timed = true;
  EXPECT_EQ(online.next(kKey, std::vector<A>{A::kShm}, &timed), A::kShm);
  EXPECT_FALSE(timed);
  EXPECT_FALSE(online.pending(kKey, std::vector<A>{A::kShm}));
}

TEST(CommOnline, BlocksInRoundsClearlySlowerCandidatesLeaveAfterThreeRounds) {
  OnlineChoice online;
  const std::vector<A> candidates = {A::kShm, A::kMpi, A::kRing};
  EXPECT_TRUE(online.pending(kKey, candidates));
  const auto calls = run_trial(online, candidates, {{A::kShm, 2e-3}, {A::kMpi, 1e-3}, {A::kRing, 3e-3}});
  const auto schedule = OnlineChoice::schedule(kKey.bytes);
  const int block = schedule.block;
  // Three full rounds, each a block per candidate (in a shuffled order); then ring has left. The table's
  // winner (shm) races to the end, and mpi beats it by 2x.
  for (int round = 0; round < 3; ++round) {
    std::vector<A> blocks;
    for (int b = 0; b < 3; ++b) {
      const int first = (round * 3 + b) * block;
      for (int i = first; i < first + block; ++i) EXPECT_EQ(calls[i], calls[first]) << i;
      blocks.push_back(calls[first]);
    }
    std::sort(blocks.begin(), blocks.end());
    EXPECT_EQ(blocks, (std::vector<A>{A::kRing, A::kShm, A::kMpi})) << round;  // enum order
  }
  EXPECT_EQ(std::count(calls.begin(), calls.end(), A::kRing), 3 * block);
  EXPECT_EQ(calls.size(), static_cast<size_t>((2 * schedule.max_rounds + 3) * block));
  EXPECT_FALSE(online.pending(kKey, candidates));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(kept(online, candidates), A::kMpi);
  ASSERT_EQ(online.medians(kKey).size(), 3u);
  EXPECT_DOUBLE_EQ(online.medians(kKey)[1], 1e-3);
}

TEST(CommOnline, TheRaceEndsEarlyWhenOnlyTheTablesWinnerIsLeft) {
  OnlineChoice online;
  const std::vector<A> candidates = {A::kShm, A::kMpi, A::kRing};
  const auto calls = run_trial(online, candidates, {{A::kShm, 1e-3}, {A::kMpi, 2e-3}, {A::kRing, 3e-3}});
  EXPECT_EQ(calls.size(), static_cast<size_t>(3 * 3 * OnlineChoice::schedule(kKey.bytes).block));
  EXPECT_EQ(kept(online, candidates), A::kShm);
}

TEST(CommOnline, TheTablesWinnerIsKeptUnlessBeatenByTheSwitchRatio) {
  // nhr leads ring (the table's winner) by 2%: inside the 3% switch ratio, ring stays. mesh, 30% behind, leaves.
  OnlineChoice online;
  const std::vector<A> candidates = {A::kRing, A::kNhr, A::kMesh};
  const auto calls = run_trial(online, candidates, {{A::kRing, 1.02e-3}, {A::kNhr, 1e-3}, {A::kMesh, 1.3e-3}});
  const auto schedule = OnlineChoice::schedule(kKey.bytes);
  EXPECT_EQ(std::count(calls.begin(), calls.end(), A::kMesh), 3 * schedule.block);
  EXPECT_EQ(std::count(calls.begin(), calls.end(), A::kNhr), schedule.max_rounds * schedule.block);
  EXPECT_EQ(kept(online, candidates), A::kRing);
  // 5% is enough to switch.
  OnlineChoice other;
  run_trial(other, candidates, {{A::kRing, 1.05e-3}, {A::kNhr, 1e-3}, {A::kMesh, 1.3e-3}});
  EXPECT_EQ(kept(other, candidates), A::kNhr);
}

TEST(CommOnline, TheSlowestRankDecides) {
  // Here mpi looks fastest, but another rank saw it take 5 ms: shm (2 ms everywhere) is kept.
  OnlineChoice online;
  const std::vector<A> candidates = {A::kShm, A::kMpi};
  run_trial(online, candidates, {{A::kShm, 2e-3}, {A::kMpi, 1e-3}}, {{A::kMpi, 5e-3}});
  EXPECT_EQ(kept(online, candidates), A::kShm);
}

TEST(CommOnline, ABlocksFirstCallIsNotCountedAndAnOutlierRoundIsOutvoted) {
  OnlineChoice online;
  const std::vector<A> candidates = {A::kShm, A::kMpi};
  const int block = OnlineChoice::schedule(kKey.bytes).block;
  int shm_calls = 0;
  for (;;) {
    bool timed = false;
    const A algo = online.next(kKey, candidates, &timed);
    if (!timed) break;
    // shm: the first call of each block takes 1 s (it follows mpi), every call of its second block 50 ms,
    // the rest 1 ms; mpi: 1.5 ms always. Counting first calls or averaging rounds would keep mpi.
    double seconds = 1.5e-3;
    if (algo == A::kShm) seconds = shm_calls % block == 0 ? 1.0 : shm_calls / block == 1 ? 50e-3 : 1e-3;
    shm_calls += algo == A::kShm;
    if (online.record(kKey, seconds)) online.end_round(kKey, [](std::span<double>) {});
  }
  EXPECT_EQ(kept(online, candidates), A::kShm);
  EXPECT_DOUBLE_EQ(online.medians(kKey)[0], 1e-3);
}

TEST(CommOnline, TiesKeepTheTablesWinnerAndKeysAreSeparate) {
  OnlineChoice online;
  const std::vector<A> candidates = {A::kRing, A::kNhr};
  run_trial(online, candidates, {{A::kRing, 1e-3}, {A::kNhr, 1e-3}});
  EXPECT_EQ(kept(online, candidates), A::kRing);
  // Another size, dtype or kind of memory has a trial of its own.
  for (const OnlineChoice::Key other : {OnlineChoice::Key{2 << 20, CommDType::kF32, false},
                                        OnlineChoice::Key{1 << 20, CommDType::kBF16, false},
                                        OnlineChoice::Key{1 << 20, CommDType::kF32, true}}) {
    EXPECT_TRUE(online.pending(other, candidates));
    bool timed = false;
    online.next(other, candidates, &timed);
    EXPECT_TRUE(timed);
  }
}

TEST(CommOnline, NewCandidatesStartANewTrial) {
  OnlineChoice online;
  run_trial(online, {A::kRing, A::kNhr}, {{A::kRing, 1e-3}, {A::kNhr, 2e-3}});
  const std::vector<A> changed = {A::kMesh, A::kNhr};  // a new table (set_comm_options) for the same size
  EXPECT_TRUE(online.pending(kKey, changed));
  run_trial(online, changed, {{A::kMesh, 3e-3}, {A::kNhr, 2e-3}});
  EXPECT_EQ(kept(online, changed), A::kNhr);
}

TEST(CommOnline, ScheduleAndDropRatio) {
  EXPECT_EQ(OnlineChoice::max_trial_calls(4096, 2), 2 * 8 * 20);
  EXPECT_EQ(OnlineChoice::max_trial_calls(1 << 20, 2), 2 * 4 * 16);
  EXPECT_EQ(OnlineChoice::max_trial_calls(8 << 20, 3), 3 * 4 * 12);
  EXPECT_EQ(OnlineChoice::max_trial_calls(256 << 20, 4), 4 * 3 * 8);
  EXPECT_DOUBLE_EQ(OnlineChoice::drop_ratio(3), 1.20);
  EXPECT_DOUBLE_EQ(OnlineChoice::drop_ratio(6), 1.125);
  EXPECT_GT(OnlineChoice::drop_ratio(20), 1.05);
}

std::vector<A> candidates_for(CommDType dtype, bool shm_available, uint64_t bytes = 1 << 20) {
  const auto c = allreduce_candidates(A::kAuto, 2, dtype, bytes, shm_available);
  return {c.algos.begin(), c.algos.begin() + c.count};
}

TEST(CommOnline, CandidatesComeFromTheTablesAlternates) {
  const std::string path = ::testing::TempDir() + "comm_online_table.json";
  TuningTable table;
  table.add({Collective::kAllreduce, 2, CommDType::kF32, 1 << 20, "mesh", 9.0, false,
             {"shm", "mpi", "ring", "nhr", "rd", "rabenseifner"}});
  table.add({Collective::kAllreduce, 2, CommDType::kBF16, 1 << 20, "ring", 9.0, false, {"mpi", "nhr"}});
  table.save(path);
  CommOptions options;
  options.tuning_path = path;
  set_comm_options(options);
  // Winner first, then the alternates in the table's order, at most six in all.
  EXPECT_EQ(candidates_for(CommDType::kF32, true),
            (std::vector<A>{A::kMesh, A::kShm, A::kMpi, A::kRing, A::kNhr, A::kRecursiveDoubling}));
  // shm only where all ranks share a node; mpi sends fp32, so it is no candidate for a bf16 sum.
  EXPECT_EQ(candidates_for(CommDType::kF32, false),
            (std::vector<A>{A::kMesh, A::kMpi, A::kRing, A::kNhr, A::kRecursiveDoubling, A::kRabenseifner}));
  EXPECT_EQ(candidates_for(CommDType::kBF16, true), (std::vector<A>{A::kRing, A::kNhr}));
  EXPECT_EQ(select_allreduce(A::kAuto, 2, CommDType::kF32, 1 << 20, true), A::kMesh);
  EXPECT_FALSE(allreduce_candidates(A::kAuto, 2, CommDType::kF32, 1 << 20, true).force_trial);
  options.online = true;  // MOEX_COMM_ONLINE=1
  set_comm_options(options);
  EXPECT_TRUE(allreduce_candidates(A::kAuto, 2, CommDType::kF32, 1 << 20, true).force_trial);
  // An explicit algorithm, or the trial turned off: one candidate.
  EXPECT_EQ(allreduce_candidates(A::kNhr, 2, CommDType::kF32, 1 << 20, true).count, 1);
  options.online = false;
  set_comm_options(options);
  EXPECT_EQ(candidates_for(CommDType::kF32, true), (std::vector<A>{A::kMesh}));
  set_comm_options(CommOptions{A::kAuto, AlltoallAlgo::kAuto, "none"});
  std::remove(path.c_str());
}

TEST(CommOnline, AnUnknownAlternateIsABadTable) {
  const std::string path = ::testing::TempDir() + "comm_online_bad.json";
  std::ofstream(path) << R"({"entries": [{"collective": "allreduce", "group_size": 2, "bytes": 8, "algo": "ring",)"
                      << R"( "alternates": ["ring", "warp"]}]})";
  try {
    TuningTable::load(path);
    FAIL() << "loaded";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_NE(std::string(e.what()).find("warp"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  std::remove(path.c_str());
}

TEST(CommOnline, EnvironmentSwitch) {
  setenv("MOEX_COMM_ONLINE", "0", 1);
  EXPECT_EQ(comm_options_from_flags("", "", "none").online, false);
  setenv("MOEX_COMM_ONLINE", "1", 1);
  EXPECT_EQ(comm_options_from_flags("", "", "none").online, true);
  setenv("MOEX_COMM_ONLINE", "yes", 1);
  EXPECT_THROW(comm_options_from_flags("", "", "none"), Error);
  unsetenv("MOEX_COMM_ONLINE");
  EXPECT_FALSE(comm_options_from_flags("", "", "none").online.has_value());  // on unless oversubscribed
}

}  // namespace
}  // namespace moex::comm
