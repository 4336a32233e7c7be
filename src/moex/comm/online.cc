#include "moex/comm/online.h"

#include <algorithm>

#include "moex/base/error.h"

namespace moex::comm {
namespace {

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t m = values.size() / 2;
  return values.size() % 2 ? values[m] : 0.5 * (values[m - 1] + values[m]);
}

bool same_candidates(std::span<const AllreduceAlgo> a, std::span<const AllreduceAlgo> b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

}  // namespace

int OnlineChoice::samples_per_candidate(uint64_t bytes) {
  if (bytes <= (1u << 20)) return 11;
  return bytes <= (16u << 20) ? 7 : 5;
}

int OnlineChoice::total_calls(const Key& key, int count) const {
  return count * (1 + samples_per_candidate(key.bytes));  // one warm-up round, then the timed rounds
}

OnlineChoice::Trial* OnlineChoice::find_or_start(const Key& key, std::span<const AllreduceAlgo> candidates) {
  auto it = trials_.find(key);
  if (it != trials_.end()) {
    Trial& trial = it->second;
    // The table changed under a running process (set_comm_options): start again with the new candidates.
    if (!same_candidates({trial.candidates.data(), static_cast<size_t>(trial.count)}, candidates)) trial = Trial{};
    else return &trial;
  } else {
    if (trials_.size() >= kMaxKeys) return nullptr;
    it = trials_.emplace(key, Trial{}).first;
  }
  Trial& trial = it->second;
  trial.count = static_cast<int>(candidates.size());
  std::copy_n(candidates.begin(), trial.count, trial.candidates.begin());
  return &trial;
}

AllreduceAlgo OnlineChoice::next(const Key& key, std::span<const AllreduceAlgo> candidates, bool* timed) {
  *timed = false;
  MOEX_CHECK(!candidates.empty(), "online choice without candidates");
  candidates = candidates.first(std::min<size_t>(candidates.size(), kMaxCandidates));
  if (candidates.size() == 1) return candidates[0];
  Trial* trial = find_or_start(key, candidates);
  if (!trial) return candidates[0];
  if (trial->settled) return trial->kept;
  // Round-robin: round k gives every candidate its k-th call, so drift during the trial hits all alike.
  trial->last = trial->calls % trial->count;
  ++trial->calls;
  *timed = true;
  return trial->candidates[trial->last];
}

bool OnlineChoice::record(const Key& key, double seconds) {
  auto it = trials_.find(key);
  MOEX_CHECK(it != trials_.end() && !it->second.settled && it->second.last >= 0, "online choice: no trial call in flight");
  Trial& trial = it->second;
  if (trial.calls > trial.count) trial.seconds[trial.last].push_back(seconds);  // round 0 warms up, untimed
  trial.last = -1;
  return trial.calls >= total_calls(key, trial.count);
}

AllreduceAlgo OnlineChoice::settle(const Key& key, const std::function<void(std::span<double>)>& max_over_ranks) {
  auto it = trials_.find(key);
  MOEX_CHECK(it != trials_.end() && !it->second.settled, "online choice: nothing to settle");
  Trial& trial = it->second;
  trial.results.resize(trial.count);
  for (int i = 0; i < trial.count; ++i) trial.results[i] = median(trial.seconds[i]);
  max_over_ranks(trial.results);
  int best = 0;
  for (int i = 1; i < trial.count; ++i)
    if (trial.results[i] < trial.results[best]) best = i;
  trial.kept = trial.candidates[best];
  trial.settled = true;
  for (auto& samples : trial.seconds) samples = {};
  return trial.kept;
}

bool OnlineChoice::pending(const Key& key, std::span<const AllreduceAlgo> candidates) const {
  candidates = candidates.first(std::min<size_t>(candidates.size(), kMaxCandidates));
  if (candidates.size() <= 1) return false;
  auto it = trials_.find(key);
  if (it == trials_.end()) return trials_.size() < kMaxKeys;
  const Trial& trial = it->second;
  const bool same = same_candidates({trial.candidates.data(), static_cast<size_t>(trial.count)}, candidates);
  return !same || !trial.settled;
}

std::span<const double> OnlineChoice::results(const Key& key) const {
  auto it = trials_.find(key);
  return it == trials_.end() ? std::span<const double>() : std::span<const double>(it->second.results);
}

}  // namespace moex::comm
