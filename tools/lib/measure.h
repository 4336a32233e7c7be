// Timing and checking helpers shared by `moex bench-comm` and `moex tune-comm` (collective calls).
//
// How a size is timed (the same way for every algorithm, so a comparison inside one run is fair):
//  - each algorithm runs once on integer-valued data and is checked against the exact answer;
//  - warm-up calls estimate one call's time (slowest rank), which fixes one batch for all algorithms: enough
//    back-to-back calls that the fastest one's sample lasts ~target_sample_us (sub-microsecond collectives
//    are not timed one by one); cheap sizes get more samples (min_total_ms, max_total_ms);
//  - samples are interleaved: every algorithm's sample once per round, in a shuffled order each round, so a
//    change in machine load during the run hits every algorithm alike, and no algorithm always follows the
//    same one (a slow large call can leave the next call slow);
//  - a sample starts after a barrier with the input restored (untimed); its time is batch time / batch;
//  - per round, the slowest rank's sample; the result is the median over rounds. Two algorithms compare
//    best by paired_ratio: the median of their per-round ratios (both timed in the same round).
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "moex/comm/communicator.h"
#include "moex/comm/selector.h"

namespace moex::comm {

struct Measurement {
  double seconds = 0;          // one call: median over rounds of the slowest rank's sample
  std::vector<double> rounds;  // seconds per call in each round (slowest rank), in round order
  bool correct = true;         // the checked call matched the exact answer (within the dtype's bound) on all ranks
  double max_error = 0;        // max |result - exact| / sum_j |x_j| over elements (0 for exact)
  uint64_t bytes_sent = 0;     // by this rank in one call (from the collective's event)
  std::string_view algorithm;  // what actually ran (auto resolved)
  int batch = 1;               // calls per timed sample
};

struct MeasureOptions {
  int samples = 15;                 // timed samples per algorithm (at least)
  double min_total_ms = 0;          // more samples (up to max_samples) until the fastest algorithm has this much
  double max_total_ms = 3000;       // ... as long as all algorithms' samples at a size stay within this
  int max_samples = 101;
  int warmup = 2;                   // untimed calls per algorithm (also the time estimate)
  double target_sample_us = 1000.0; // aim for samples at least this long
  bool copy_probe = false;          // also time a plain two-process copy of the same bytes (see below)
  size_t copy_chunk_bytes = 256 << 10;  // the probe's pipeline chunk (PeakCopy::chunk_bytes)
  bool copy_streaming = false;          // the probe copies out with streaming stores (PeakCopy::streaming)
  bool registered = false;          // all-reduce buffer from Communicator::alloc_registered (shm: zero-copy)
  int max_batch = 32;             // in-place sums grow p-fold per call: p^32 stays finite in fp32 for p <= 8
};

// Samples for a message of `bytes`: `samples` below 16 MB; above, fewer (each call takes milliseconds):
// about `budget_bytes` of traffic per algorithm, but at least 5.
// (4 GB: 15 samples up to 256 MB. The sizes where every algorithm is memory-bound are also where they come
// closest to each other; a 2 GB budget gave 256 MB 8 samples, and auto's paired ratio there swung by 30%
// between runs.)
int samples_for_size(uint64_t bytes, int samples, uint64_t budget_bytes = 4ull << 30);

// All-reduce of `count` elements with each of `algos` (kAuto allowed), timed as described above.
// Returns one Measurement per entry of `algos`, in order; with options.copy_probe and at least two ranks on
// one node, one more (algorithm "copy"): rank 0 -> rank 1 through shared memory, pipelined (detail::shm_copy),
// interleaved with the algorithms' samples so the reference copy sees the same machine state.
std::vector<Measurement> measure_allreduce(Communicator& comm, std::span<const AllreduceAlgo> algos, CommDType dtype,
                                           size_t count, const MeasureOptions& options, bool random_data = false);
// Uniform all-to-all: `bytes_per_peer` to each rank (through alltoallv), checked, then timed like above.
std::vector<Measurement> measure_alltoall(Communicator& comm, std::span<const AlltoallAlgo> algos,
                                          size_t bytes_per_peer, const MeasureOptions& options);
// Median over rounds of a.rounds[r] / b.rounds[r]: how much slower a is than b, robust to drift between rounds.
double paired_ratio(const Measurement& a, const Measurement& b);
// The index of the fastest of `results` (by median), for a tuning table measured size by size (doubling).
// Hysteresis: `previous` (the previous size's winner, or SIZE_MAX) stays unless the fastest beats it by
// more than `switch_margin` in the paired ratio -- a table that flips on noise makes auto lose by the flip
// whenever the noise goes the other way, and neighbouring sizes rarely change the best algorithm. The
// margin stays well inside the 5% that auto is held to: a kept winner is never more than 3% slower.
size_t pick_winner(std::span<const Measurement> results, size_t previous, double switch_margin = 1.03);
// Makes this process keep the memory it frees (glibc: no mmap'd chunks, no trimming), as Open MPI's
// leave-pinned mode asks. Only bench-comm and tune-comm set it: glibc serves allocations of 32 MB and more with
// a fresh mmap and unmaps them on free, and MPI_Allreduce above ~32 MB allocates such a temporary per call, so
// each call faulted its pages in again (at 2 ranks, 256 MB took ~1 s instead of 49 ms and slowed the next
// collectives up to 10x) and `mpi` would be timed at its worst. The engine is left alone: comm's own large
// buffers (scratch, shared windows) are allocated once and reused.
void keep_freed_memory_for_benchmarks();
// "8", "64K", "16M", "1G" -> bytes; anything else throws Error(kInvalidInput) naming `flag` (exit 2).
uint64_t parse_byte_size(const std::string& text, const char* flag);
// Peak copy bandwidth between two ranks of this node through shared memory: the best pipeline chunk from
// 64 KB to 4 MB, with and without streaming stores, best of 5 copies of `bytes` each. Zero when fewer than two ranks share a node.
struct PeakCopy {
  double bytes_per_second = 0;
  size_t chunk_bytes = 256 << 10;
  bool streaming = false;  // the copy out used non-temporal stores
};
PeakCopy measure_peak_copy_bandwidth(Communicator& comm, size_t bytes);
// One level's link cost (selector.h LinkCost): ranks 2i and 2i+1 of `level` exchange 8 bytes, then `bytes`, both
// ways at once, every pair of every such group at the same time (every rank of `world` calls it with its own
// level group: its intra_host() or inter_host()). alpha = the small exchange, beta = the extra time per byte of
// the large one; median of `reps`, the slowest pair over `world`. A rank without a partner only waits.
LinkCost measure_link_cost(Communicator& world, Communicator& level, size_t bytes = 4 << 20, int reps = 9);

}  // namespace moex::comm
