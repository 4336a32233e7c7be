// MPI's own MPI_Allreduce as one more candidate. It sums fp32 on the wire: bf16 and fp8 callers get
// the exact fp32 path (no compression) - the bench reports those bytes as they are.
#include "moex/comm/algorithms.h"

namespace moex::comm::detail {

void allreduce_mpi(MpiCommunicator& comm, float* data, size_t count) {
  MOEX_CHECK(count <= static_cast<size_t>(INT32_MAX), "MPI_Allreduce count above 2^31");
  const int64_t start = steady_now_ns();
  comm.check(MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), MPI_FLOAT, MPI_SUM, comm.mpi_comm()),
             "MPI_Allreduce");
  auto& stats = comm.stats();
  stats.wait_ns += steady_now_ns() - start;  // MPI does not say which part was waiting
  const uint64_t moved = 2 * (comm.size() - 1) * count * 4 / comm.size();  // the ring volume: an estimate
  stats.bytes_sent += moved;
  stats.bytes_received += moved;
}

}  // namespace moex::comm::detail
