#include "moex/comm/online.h"

#include <algorithm>
#include <random>

#include "moex/base/error.h"
#include "moex/comm/stats.h"

namespace moex::comm {
namespace {

// A fresh order of blocks each round, the same on every rank (fixed seed per round): in a fixed order a
// candidate's blocks would keep the same place in the caller's pattern (say, right after each barrier of a
// 32-call batch) and the race would time the place, not the algorithm.
void shuffle_order(std::vector<int>& racing, int round) {
  std::mt19937 rng(static_cast<uint32_t>(round) * 2654435761u + 12345u);
  std::shuffle(racing.begin(), racing.end(), rng);
}

bool same_candidates(std::span<const AllreduceAlgo> a, std::span<const AllreduceAlgo> b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

std::span<const AllreduceAlgo> capped(std::span<const AllreduceAlgo> candidates) {
  return candidates.first(std::min<size_t>(candidates.size(), OnlineChoice::kMaxCandidates));
}

}  // namespace

OnlineChoice::Schedule OnlineChoice::schedule(uint64_t bytes) {
  if (bytes <= (64u << 10)) return {8, 20};  // ~1-10 us a call: the whole race costs a few milliseconds
  if (bytes <= (1u << 20)) return {4, 16};
  if (bytes <= (16u << 20)) return {4, 12};
  return {3, 8};  // up to ~50 ms a call at 256 MB
}

int OnlineChoice::max_trial_calls(uint64_t bytes, int candidates) {
  const Schedule s = schedule(bytes);
  return s.block * s.max_rounds * candidates;
}

double OnlineChoice::drop_ratio(int rounds) { return 1.05 + 0.45 / std::max(rounds, 1); }

OnlineChoice::Trial* OnlineChoice::find_or_start(const Key& key, std::span<const AllreduceAlgo> candidates) {
  auto it = trials_.find(key);
  if (it != trials_.end()) {
    Trial& trial = it->second;
    if (same_candidates({trial.candidates.data(), static_cast<size_t>(trial.count)}, candidates)) return &trial;
    trial = Trial{};  // the table changed under a running process (set_comm_options): start again
  } else {
    if (trials_.size() >= kMaxKeys) return nullptr;
    it = trials_.emplace(key, Trial{}).first;
  }
  Trial& trial = it->second;
  trial.count = static_cast<int>(candidates.size());
  std::copy(candidates.begin(), candidates.end(), trial.candidates.begin());
  for (int i = 0; i < trial.count; ++i) trial.racing.push_back(i);
  shuffle_order(trial.racing, 0);
  return &trial;
}

AllreduceAlgo OnlineChoice::next(const Key& key, std::span<const AllreduceAlgo> candidates, bool* timed) {
  *timed = false;
  MOEX_CHECK(!candidates.empty(), "online choice without candidates");
  candidates = capped(candidates);
  if (candidates.size() == 1) return candidates[0];
  if (memo_.count && memo_.key == key &&
      same_candidates({memo_.candidates.data(), static_cast<size_t>(memo_.count)}, candidates))
    return memo_.kept;
  Trial* trial = find_or_start(key, candidates);
  if (!trial) return candidates[0];
  if (trial->settled) {
    memo_ = Memo{key, trial->candidates, trial->count, trial->kept};
    return trial->kept;
  }
  const int block = schedule(key.bytes).block;
  trial->current = trial->racing[trial->call_in_round / block];
  trial->counted = trial->call_in_round % block != 0;
  ++trial->call_in_round;
  *timed = true;
  return trial->candidates[trial->current];
}

bool OnlineChoice::record(const Key& key, double seconds) {
  auto it = trials_.find(key);
  MOEX_CHECK(it != trials_.end() && !it->second.settled && it->second.current >= 0,
             "online choice: no trial call in flight");
  Trial& trial = it->second;
  if (trial.counted) {
    trial.block_seconds[trial.current] += seconds;
    ++trial.block_calls[trial.current];
  }
  trial.current = -1;
  return trial.call_in_round == static_cast<int>(trial.racing.size()) * schedule(key.bytes).block;
}

bool OnlineChoice::end_round(const Key& key, const std::function<void(std::span<double>)>& max_over_ranks) {
  auto it = trials_.find(key);
  MOEX_CHECK(it != trials_.end() && !it->second.settled, "online choice: no round to end");
  Trial& trial = it->second;
  std::vector<double> round(trial.racing.size());
  for (size_t i = 0; i < round.size(); ++i) {
    const int c = trial.racing[i];
    round[i] = trial.block_calls[c] ? trial.block_seconds[c] / trial.block_calls[c] : 0.0;
  }
  max_over_ranks(round);
  for (size_t i = 0; i < round.size(); ++i) trial.samples[trial.racing[i]].push_back(round[i]);
  trial.block_seconds = {};
  trial.block_calls = {};
  trial.call_in_round = 0;
  const int rounds = static_cast<int>(trial.samples[trial.racing[0]].size());
  // The leader: the smallest median over rounds (ties: the earlier candidate, the table's winner first).
  std::vector<int> by_index = trial.racing;  // racing is in this round's shuffled order
  std::sort(by_index.begin(), by_index.end());
  int leader = by_index[0];
  for (int c : by_index)
    if (median(trial.samples[c]) < median(trial.samples[leader])) leader = c;
  // The table's winner (candidate 0) is the incumbent: it never leaves the race, and it is kept unless the
  // leader beats it by more than kSwitchRatio, paired. On 2 cores, 4 ranks time a call with 2x noise; a race
  // among six would otherwise often crown a lucky one over a winner the table measured far more carefully.
  if (rounds >= 3) {
    std::erase_if(trial.racing, [&](int c) {
      return c != leader && c != 0 && paired_median_ratio(trial.samples[c], trial.samples[leader]) > drop_ratio(rounds);
    });
  }
  if (trial.racing.size() == 1 || rounds >= schedule(key.bytes).max_rounds) {
    if (leader != 0 && paired_median_ratio(trial.samples[0], trial.samples[leader]) <= kSwitchRatio) leader = 0;
    trial.settled = true;
    trial.kept = trial.candidates[leader];
  }
  shuffle_order(trial.racing, rounds);
  return trial.settled;
}

bool OnlineChoice::pending(const Key& key, std::span<const AllreduceAlgo> candidates) const {
  candidates = capped(candidates);
  if (candidates.size() <= 1) return false;
  auto it = trials_.find(key);
  if (it == trials_.end()) return trials_.size() < kMaxKeys;
  const Trial& trial = it->second;
  return !same_candidates({trial.candidates.data(), static_cast<size_t>(trial.count)}, candidates) || !trial.settled;
}

std::vector<double> OnlineChoice::medians(const Key& key) const {
  auto it = trials_.find(key);
  if (it == trials_.end() || it->second.samples[0].empty()) return {};
  std::vector<double> out;
  for (int c = 0; c < it->second.count; ++c) out.push_back(median(it->second.samples[c]));
  return out;
}

}  // namespace moex::comm
