// Auto's choice refined at run time, among the few algorithms the tuning table found close.
//
// `moex tune-comm` stores, next to each size's winner, the algorithms that came within a few tens of percent
// of it ("alternates"). On a shared-memory node their order can flip from one run to the next (which pages
// a window got, what the other core is doing): at 2 ranks MPI_Allreduce and the shm path trade places by
// 10-20% between runs at 1-8 MB. A table measured in one run cannot follow that, so when an entry has
// alternates the first calls at that message size are a trial: the candidates take turns, each call starts
// after a barrier and is timed; when every candidate has its samples, the ranks take the maximum over ranks
// of each candidate's median (one small MPI_Allreduce) and keep the fastest for the rest of the run.
// Every input (the order of calls, their sizes, the table) is the same on every rank, so every rank runs the
// same algorithm on every call, during the trial and after it.
//
// Pure bookkeeping: no MPI here (the caller times the calls and supplies the max-over-ranks step), so the
// rules are unit-tested without ranks. MOEX_COMM_ONLINE=0 turns the trial off (auto keeps the table's winner).
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <unordered_map>
#include <vector>

#include "moex/comm/types.h"

namespace moex::comm {

class OnlineChoice {
 public:
  static constexpr int kMaxCandidates = 4;
  // Distinct message sizes that get a trial; later new sizes keep the table's winner (a workload of ever new
  // sizes would otherwise stay in trials).
  static constexpr size_t kMaxKeys = 1024;

  struct Key {
    uint64_t bytes = 0;
    CommDType dtype = CommDType::kF32;
    bool registered = false;
    bool operator==(const Key&) const = default;
  };

  // Timed calls per candidate (after one untimed warm-up call each): more for small sizes, whose single calls
  // are noisier and cheap; at least 5 so a median ignores two outliers.
  static int samples_per_candidate(uint64_t bytes);

  // The algorithm for this call with `candidates` (the table's winner first, at most kMaxCandidates).
  // *timed: the call is part of the trial; time it (after a barrier) and pass the seconds to record().
  AllreduceAlgo next(const Key& key, std::span<const AllreduceAlgo> candidates, bool* timed);
  // This rank's time for the trial call next() just handed out. True when that was the trial's last call:
  // then settle() must be called (by every rank: they all reach it at the same call).
  bool record(const Key& key, double seconds);
  // Ends the trial: `max_over_ranks` replaces each value by its maximum over ranks, in place (the caller's
  // collective). Keeps the candidate with the smallest result (ties: the earlier one) and returns it.
  AllreduceAlgo settle(const Key& key, const std::function<void(std::span<double>)>& max_over_ranks);
  // True while calls with `key` and these candidates would still be trial calls.
  bool pending(const Key& key, std::span<const AllreduceAlgo> candidates) const;
  // The trial's per-candidate results (seconds, max over ranks) once settled; empty before.
  std::span<const double> results(const Key& key) const;

 private:
  struct KeyHash {
    size_t operator()(const Key& key) const {
      return std::hash<uint64_t>()(key.bytes * 8 + static_cast<uint64_t>(key.dtype) * 2 + key.registered);
    }
  };
  struct Trial {
    std::array<AllreduceAlgo, kMaxCandidates> candidates{};
    int count = 0;
    int calls = 0;       // trial calls handed out so far
    int last = -1;       // candidate of the call in flight
    bool settled = false;
    AllreduceAlgo kept = AllreduceAlgo::kAuto;
    std::array<std::vector<double>, kMaxCandidates> seconds;  // timed calls, per candidate
    std::vector<double> results;                              // after settle: max over ranks of the medians
  };
  Trial* find_or_start(const Key& key, std::span<const AllreduceAlgo> candidates);
  int total_calls(const Key& key, int count) const;
  std::unordered_map<Key, Trial, KeyHash> trials_;
};

}  // namespace moex::comm
