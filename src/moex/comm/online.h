// Auto's choice refined at run time, among the few algorithms the tuning table found close.
//
// `moex tune-comm` stores, next to each size's winner, up to five algorithms that came within 2x of it
// ("alternates"). On a shared-memory node their order can flip from one run to the next (at 2 ranks the
// MPI-based algorithms took 330, 451 and >534 us at 2 MB in three runs, shm 327-372 us), and a table measured
// in one run cannot follow that. So when an entry has alternates, the first calls at that message size are a
// trial, run as a race:
//  - in each round every candidate still in the race takes a block of consecutive calls; the block's first
//    call (which follows another algorithm) is not counted, the mean of the others is its sample;
//  - at the end of a round the ranks agree on the round's samples (max over ranks: one small MPI_Allreduce);
//  - from the third round on, a candidate whose paired ratio to the leader (median over rounds of the ratio
//    within a round) is above drop_ratio(rounds) leaves the race: clearly slower ones stop costing calls,
//    close ones get the samples a close call needs; the table's winner stays to the end;
//  - the race ends when only the table's winner is left or after the schedule's rounds; the leader is kept
//    for the rest of the run if it beats the table's winner by more than kSwitchRatio (3%), else the winner.
// Calls are timed as the caller makes them, with nothing added (no barrier): which algorithm is faster
// depends on the state a call finds. Measured at 2 ranks, mpi against shm: one call after a barrier, mpi
// faster by ~40% at 2 MB and ~25% at 8 MB; back-to-back calls, by 8% and 0%; one call on a freshly written
// buffer, mpi faster by 23% at 2 MB but shm faster by 24% at 8 MB. Only the caller's own calls tell.
// Every input (the order of calls, their sizes, the table, the agreed samples) is the same on every rank, so
// every rank runs the same algorithm on every call, during the trial and after it.
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
  static constexpr int kMaxCandidates = 6;
  // Distinct message sizes that get a trial; later new sizes keep the table's winner (a workload of ever new
  // sizes would otherwise stay in trials).
  static constexpr size_t kMaxKeys = 1024;

  struct Key {
    uint64_t bytes = 0;
    CommDType dtype = CommDType::kF32;
    bool registered = false;
    bool operator==(const Key&) const = default;
  };

  // A race at a message size: blocks of `block` calls, at most `max_rounds` rounds. Cheap sizes get more.
  struct Schedule {
    int block = 4, max_rounds = 12;
  };
  static Schedule schedule(uint64_t bytes);
  // The most calls a race among `candidates` can take (no candidate dropped).
  static int max_trial_calls(uint64_t bytes, int candidates);
  // After `rounds` rounds (3 or more), a candidate this much slower than the leader (paired) leaves the race:
  // 1.20 after 3 rounds, 1.125 after 6, 1.08 after 15 (more rounds, smaller noise, finer cut). The table's
  // winner never leaves.
  static double drop_ratio(int rounds);
  // The table's winner is kept unless the race's leader beats it by more than this (paired).
  static constexpr double kSwitchRatio = 1.03;

  // The algorithm for this call with `candidates` (the table's winner first; beyond kMaxCandidates ignored).
  // *timed: the call is part of the trial; time it and pass the seconds to record().
  AllreduceAlgo next(const Key& key, std::span<const AllreduceAlgo> candidates, bool* timed);
  // This rank's time for the trial call next() just handed out. True when that call ended a round: then
  // end_round() must be called (by every rank: they all reach it at the same call).
  bool record(const Key& key, double seconds);
  // Ends the round: `max_over_ranks` replaces each value by its maximum over ranks, in place (the caller's
  // collective). Drops candidates, and ends the trial when it is decided; returns true when it ended.
  bool end_round(const Key& key, const std::function<void(std::span<double>)>& max_over_ranks);
  // True while calls with `key` and these candidates would still be trial calls.
  bool pending(const Key& key, std::span<const AllreduceAlgo> candidates) const;
  // Per candidate: the median over the rounds it ran of its agreed samples (seconds per call); empty until
  // the first round ends.
  std::vector<double> medians(const Key& key) const;

 private:
  struct KeyHash {
    size_t operator()(const Key& key) const {
      return std::hash<uint64_t>()(key.bytes * 8 + static_cast<uint64_t>(key.dtype) * 2 + key.registered);
    }
  };
  struct Trial {
    std::array<AllreduceAlgo, kMaxCandidates> candidates{};
    int count = 0;
    std::vector<int> racing;  // candidates in this round, in order
    int call_in_round = 0;    // calls handed out in this round
    int current = -1;         // candidate of the call in flight
    bool counted = false;     // the call in flight is not the first of its block
    std::array<double, kMaxCandidates> block_seconds{};  // this round, this rank
    std::array<int, kMaxCandidates> block_calls{};
    std::array<std::vector<double>, kMaxCandidates> samples;  // agreed, one per round raced
    bool settled = false;
    AllreduceAlgo kept = AllreduceAlgo::kAuto;
  };
  Trial* find_or_start(const Key& key, std::span<const AllreduceAlgo> candidates);
  std::unordered_map<Key, Trial, KeyHash> trials_;
  // The last settled decision handed out: repeated calls of one size skip the map (a lookup is ~3% of a
  // 0.6 us all-reduce).
  struct Memo {
    Key key;
    std::array<AllreduceAlgo, kMaxCandidates> candidates{};
    int count = 0;
    AllreduceAlgo kept = AllreduceAlgo::kAuto;
  } memo_;
};

}  // namespace moex::comm
