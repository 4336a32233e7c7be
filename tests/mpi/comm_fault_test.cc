// A rank that dies (or stalls) in the middle of a collective must end the job with a clear error, not a
// hang. Mode `exit`: rank 1 exits before its part of an all-reduce; mpirun sees it and kills the job.
// Mode `stall`: rank 1 stops calling collectives; the others' watchdog (MOEX_COMM_TIMEOUT) fires, they
// print the comm error and abort the job. comm_fault_test.sh checks the time bound and the messages.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "moex/base/error.h"
#include "moex/comm/communicator.h"

using namespace moex::comm;

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "exit";
  const char* algo_name_arg = argc > 2 ? argv[2] : "ring";
  Communicator& comm = init();
  const AllreduceAlgo algo = *allreduce_algo_from_name(algo_name_arg);
  std::vector<float> data(1 << 16, 1.0f);
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
