// Timing and checking helpers shared by `moex bench-comm` and `moex tune-comm` (collective calls).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moex/comm/communicator.h"

namespace moex::comm {

struct Measurement {
  double seconds = 0;          // median over iterations of the slowest rank's time
  bool correct = true;         // the first call's result matched the exact answer (within the dtype's bound)
  double max_error = 0;        // max |result - exact| / sum_j |x_j| over elements (0 for exact)
  uint64_t bytes_sent = 0;     // by this rank in one call (from the collective's event)
  std::string_view algorithm;  // what actually ran (auto resolved)
};

// All-reduce of `count` elements: one checked call on integer-valued data, then `warmup` + `iters`
// timed calls, each started together after a barrier with the input restored (untimed).
Measurement measure_allreduce(Communicator& comm, AllreduceAlgo algo, CommDType dtype, size_t count, int warmup,
                              int iters, bool random_data = false);
// Uniform all-to-all: `bytes_per_peer` to each rank (as alltoallv), checked, then timed like above.
Measurement measure_alltoall(Communicator& comm, AlltoallAlgo algo, size_t bytes_per_peer, int warmup, int iters);
// "8", "64K", "16M", "1G" -> bytes; anything else throws Error(kInvalidInput) naming `flag` (exit 2).
uint64_t parse_byte_size(const std::string& text, const char* flag);
// Peak copy bandwidth between two ranks of this node through shared memory (bytes/s); 0 if impossible.
double measure_peak_copy_bandwidth(Communicator& comm, size_t bytes);

}  // namespace moex::comm
