// MPI's own MPI_Alltoallv (bytes), as one more candidate.
#include <vector>

#include "moex/comm/algorithms.h"

namespace moex::comm::detail {

void alltoall_mpi(MpiCommunicator& comm, const AlltoallArgs& args) {
  const int p = comm.size();
  static thread_local std::vector<int> counts_and_offsets;  // [4p]: send counts, send offsets, recv ...
  counts_and_offsets.resize(4 * p);
  int* send_counts = counts_and_offsets.data();
  int* send_offsets = send_counts + p;
  int* recv_counts = send_offsets + p;
  int* recv_offsets = recv_counts + p;
  for (int j = 0; j < p; ++j) {
    MOEX_CHECK((args.send_offsets[j] + args.send_counts[j]) * args.elem_bytes <= INT32_MAX &&
                   (args.recv_offsets[j] + args.recv_counts[j]) * args.elem_bytes <= INT32_MAX,
               "MPI_Alltoallv buffers above 2 GiB");
    send_counts[j] = static_cast<int>(args.send_counts[j] * args.elem_bytes);
    send_offsets[j] = static_cast<int>(args.send_offsets[j] * args.elem_bytes);
    recv_counts[j] = static_cast<int>(args.recv_counts[j] * args.elem_bytes);
    recv_offsets[j] = static_cast<int>(args.recv_offsets[j] * args.elem_bytes);
  }
  auto& stats = comm.stats();
  for (int j = 0; j < p; ++j) {
    if (j == comm.rank()) continue;
    stats.bytes_sent += send_counts[j];
    stats.bytes_received += recv_counts[j];
  }
  const int64_t start = steady_now_ns();
  comm.check(MPI_Alltoallv(args.send, send_counts, send_offsets, MPI_BYTE, args.recv, recv_counts, recv_offsets,
                           MPI_BYTE, comm.mpi_comm()),
             "MPI_Alltoallv");
  stats.wait_ns += steady_now_ns() - start;
}

}  // namespace moex::comm::detail
