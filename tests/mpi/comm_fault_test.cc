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
#include <vector>

#include "moex/base/error.h"
#include "moex/comm/communicator.h"
#include "moex/comm/job.h"

using namespace moex::comm;

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "exit";
  const char* algo_name_arg = argc > 2 ? argv[2] : "ring";
  Communicator& comm = init();
  const AllreduceAlgo algo = *allreduce_algo_from_name(algo_name_arg);
  std::vector<float> data(1 << 16, 1.0f);
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
    comm.allreduce(data.data(), data.size(), CommDType::kF32, algo);  // everyone healthy once
    if (comm.rank() == 1) {
      if (std::strcmp(mode, "exit") == 0) {
        std::fprintf(stderr, "fault test: rank 1 exits in the middle of an all-reduce\n");
        std::fflush(stderr);
        _exit(7);
      }
      std::fprintf(stderr, "fault test: rank 1 stalls instead of calling the all-reduce\n");
      sleep(120);
      return 0;
    }
    for (int i = 0; i < 3; ++i) comm.allreduce(data.data(), data.size(), CommDType::kF32, algo);
    std::fprintf(stderr, "fault test: rank %d finished, which should be impossible\n", comm.rank());
    return 0;
  } catch (const moex::Error& e) {
    std::fprintf(stderr, "moex: error: %s\n", e.what());
    finalize();  // aborts the job: the failure was a comm error
    return e.exit_code();
  }
}
