// Bruck all-to-all for small messages: ceil(log2 p) steps instead of p-1. Blocks are rotated so block i
// is meant for rank r+i; at step k every block whose index has bit k set moves to rank r+2^k. Counts are
// uneven and only the sender of a block knows its size, so each message carries its block sizes in a
// header and the receiver probes for the message length. Block i ends on rank r having come from r-i.
#include <sched.h>

#include <cstring>
#include <vector>

#include "moex/comm/algorithms.h"

namespace moex::comm::detail {
namespace {

// Receives the next message from `src` whatever its length (into `buffer`), with the comm watchdog.
void receive_any_length(MpiCommunicator& comm, int src, std::vector<std::byte>& buffer) {
  const int64_t start = steady_now_ns();
  const int64_t limit_ns = static_cast<int64_t>(comm_timeout_seconds() * 1e9);
  MPI_Status status;
  for (uint64_t spins = 0;; ++spins) {
    int found = 0;
    comm.check(MPI_Iprobe(src, 1, comm.mpi_comm(), &found, &status), "MPI_Iprobe");
    if (found) break;
    if (spins > 256) sched_yield();
    if ((spins & 1023) == 1023 && steady_now_ns() - start > limit_ns)
      throw_comm_error(::moex::detail::concat(comm.stats().operation, ": rank ", comm.rank(), " waited ",
                                      comm_timeout_seconds(), " s for rank ", src,
                                      "; a rank has died or stopped calling collectives in the same order"));
  }
  int bytes = 0;
  MPI_Get_count(&status, MPI_BYTE, &bytes);
  buffer.resize(bytes);
  comm.check(MPI_Recv(buffer.data(), bytes, MPI_BYTE, src, 1, comm.mpi_comm(), MPI_STATUS_IGNORE), "MPI_Recv");
  comm.stats().wait_ns += steady_now_ns() - start;
  comm.stats().bytes_received += bytes;
}

}  // namespace

void alltoall_bruck(MpiCommunicator& comm, const AlltoallArgs& args) {
  const int p = comm.size(), r = comm.rank();
  const size_t elem = args.elem_bytes;
  // Reused across calls (grow only): the blocks held now and after the step, and the two messages.
  static thread_local std::vector<std::byte> held, next, outgoing, incoming;
  static thread_local std::vector<uint64_t> held_bytes, held_offsets, next_bytes;  // [p] per relative block
  held_bytes.resize(p);
  held_offsets.resize(p);
  next_bytes.resize(p);
  size_t total = 0;
  for (int i = 0; i < p; ++i) total += args.send_counts[(r + i) % p] * elem;
  held.resize(total);
  for (int i = 0, offset = 0; i < p; ++i) {
    const int dest = (r + i) % p;
    held_bytes[i] = args.send_counts[dest] * elem;
    held_offsets[i] = offset;
    std::memcpy(held.data() + offset, args.send + args.send_offsets[dest] * elem, held_bytes[i]);
    offset += held_bytes[i];
  }
  for (int distance = 1; distance < p; distance <<= 1) {
    const int dest = (r + distance) % p, src = (r + p - distance) % p;
    // Outgoing message: [sizes of the moving blocks, uint64 each][their bytes, in index order].
    size_t moving = 0, payload = 0;
    for (int i = 1; i < p; ++i)
      if (i & distance) ++moving, payload += held_bytes[i];
    outgoing.resize(moving * 8 + payload);
    auto* sizes = reinterpret_cast<uint64_t*>(outgoing.data());
    std::byte* cursor = outgoing.data() + moving * 8;
    for (int i = 1, m = 0; i < p; ++i) {
      if (!(i & distance)) continue;
      sizes[m++] = held_bytes[i];
      std::memcpy(cursor, held.data() + held_offsets[i], held_bytes[i]);
      cursor += held_bytes[i];
    }
    P2PRequest send = comm.isend(outgoing.data(), outgoing.size(), dest, 1);
    receive_any_length(comm, src, incoming);
    comm.wait_all({&send, 1});
    // Rebuild the held blocks: the moving indices now hold what src sent, the rest stay.
    const auto* in_sizes = reinterpret_cast<const uint64_t*>(incoming.data());
    const std::byte* in_cursor = incoming.data() + moving * 8;
    size_t next_total = 0;
    for (int i = 0, m = 0; i < p; ++i) next_bytes[i] = (i & distance) ? in_sizes[m++] : held_bytes[i];
    for (int i = 0; i < p; ++i) next_total += next_bytes[i];
    next.resize(next_total);
    for (int i = 0, offset = 0; i < p; ++i) {
      const std::byte* from = (i & distance) ? in_cursor : held.data() + held_offsets[i];
      std::memcpy(next.data() + offset, from, next_bytes[i]);
      if (i & distance) in_cursor += next_bytes[i];
      held_offsets[i] = offset;
      offset += next_bytes[i];
    }
    std::swap(held, next);
    std::swap(held_bytes, next_bytes);
  }
  for (int i = 0; i < p; ++i) {
    const int src = (r + p - i) % p;
    MOEX_CHECK(held_bytes[i] == args.recv_counts[src] * elem, "alltoallv: rank ", src, " sent ", held_bytes[i],
               " bytes but recv_counts expects ", args.recv_counts[src] * elem);
    std::memcpy(args.recv + args.recv_offsets[src] * elem, held.data() + held_offsets[i], held_bytes[i]);
  }
}

}  // namespace moex::comm::detail
