// A rank that dies (or stalls) in the middle of a collective must end the job with a clear error, not a
// hang. Mode `exit`: rank 1 exits before its part of an all-reduce; mpirun sees it and kills the job.
// Mode `stall`: rank 1 stops calling collectives; the others' watchdog (MOEX_COMM_TIMEOUT) fires, they
// print the comm error and abort the job. comm_fault_test.sh checks the time bound and the messages.
// Mode `throw`: rank 1 raises an input error (exit 2) while the others wait in an all-reduce on registered
// (shared-window) memory; `throw_all`: every rank raises one, rank 0's differing from the rest. Both end
// through abort_job; check_rank_failures.py checks the exit code, that each distinct message is printed
// once, and that /dev/shm is left clean.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "moex/base/error.h"
#include "moex/comm/communicator.h"
#include "moex/comm/job.h"

using namespace moex::comm;

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "exit";
  const char* algo_name_arg = argc > 2 ? argv[2] : "ring";
  Communicator& comm = init();
  // ALGO names an all-reduce algorithm, or one of the other collectives a stalled peer must not hang:
  // alltoallv (its size agreement), broadcast, barrier.
  const std::string which = algo_name_arg;
  const bool other = which == "alltoallv" || which == "broadcast" || which == "barrier";
  const AllreduceAlgo algo = other ? AllreduceAlgo::kRing : *allreduce_algo_from_name(algo_name_arg);
  std::vector<float> data(1 << 16, 1.0f);
  std::vector<float> received(data.size());
  const auto collective = [&] {
    if (which == "alltoallv") {
      const size_t n = comm.size();
      std::vector<size_t> counts(n, 16), offsets(n);
      for (size_t i = 0; i < n; ++i) offsets[i] = i * 16;
      comm.alltoallv(data.data(), counts, offsets, received.data(), counts, offsets, sizeof(float));
    } else if (which == "broadcast") {
      comm.broadcast(data.data(), 64, 1);  // rooted at the rank that stalls, so the others wait on it
    } else if (which == "barrier") {
      comm.barrier();
    } else {
      comm.allreduce(data.data(), data.size(), CommDType::kF32, algo);
    }
  };
  if (std::strcmp(mode, "throw") == 0 || std::strcmp(mode, "throw_all") == 0) {
    float* shared = static_cast<float*>(comm.alloc_registered(data.size() * sizeof(float)));
    comm.allreduce(shared, data.size(), CommDType::kF32, algo);
    if (comm.rank() == 1 || std::strcmp(mode, "throw_all") == 0) {
      const char* what = comm.rank() == 0 ? "fault test: rank 0's own error" : "fault test: the same error";
      abort_job(2, what, "moex: error: ");
    }
    for (int i = 0; i < 3; ++i) comm.allreduce(shared, data.size(), CommDType::kF32, algo);
    std::fprintf(stderr, "fault test: rank %d finished, which should be impossible\n", comm.rank());
    return 0;
  }
  try {
    collective();  // everyone healthy once
    if (comm.rank() == 1) {
      if (std::strcmp(mode, "exit") == 0) {
        std::fprintf(stderr, "fault test: rank 1 exits in the middle of an all-reduce\n");
        std::fflush(stderr);
        _exit(7);
      }
      std::fprintf(stderr, "fault test: rank 1 stalls instead of calling the %s\n", algo_name_arg);
      sleep(120);
      return 0;
    }
    for (int i = 0; i < 3; ++i) collective();
    std::fprintf(stderr, "fault test: rank %d finished, which should be impossible\n", comm.rank());
    return 0;
  } catch (const moex::Error& e) {
    std::fprintf(stderr, "moex: error: %s\n", e.what());
    finalize();  // aborts the job: the failure was a comm error
    return e.exit_code();
  }
}
