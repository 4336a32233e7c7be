// Shared pieces of the algorithm files (one file per algorithm). Internal to comm.
// Every all-reduce algorithm works on an fp32 buffer data [count]; `wire` says what is copied between
// ranks. Lossy wire formats (bf16, fp8) follow two rules: a rank that finishes a value keeps
// decode(encode(value)) so every rank ends bit-identical, and buffers are cut at multiples of
// wire_granule() so re-encoding a received block gives back the same bytes.
#pragma once
#include <span>
#include <vector>

#include "moex/base/error.h"

#include "moex/comm/codec.h"
#include "moex/comm/mpi_communicator.h"
#include "moex/comm/selector.h"

namespace moex::comm::detail {

// `count` elements cut into `parts` nearly equal pieces whose edges fall on multiples of `granule`.
struct Partition {
  size_t count;
  size_t granule;
  int parts;
  size_t begin(int part) const {
    const size_t units = (count + granule - 1) / granule;
    const size_t unit = units * static_cast<size_t>(part) / static_cast<size_t>(parts);
    return std::min(count, unit * granule);
  }
  size_t end(int part) const { return begin(part + 1); }
  size_t size(int part) const { return end(part) - begin(part); }
};

struct Range {
  size_t begin = 0, count = 0;  // elements
};

// Pieces [first, first + n) of a partition, taken cyclically (mod parts): one or two element ranges.
int cyclic_ranges(const Partition& partition, int first, int n, Range out[2]);

// Sends data[send_ranges] to `dest` while receiving data[recv_ranges] from `src`; the received values are
// added into data (add = true, a reduce step) or overwrite it (an all-gather step). Either side may be
// empty (dest/src < 0 or no ranges).
void exchange(MpiCommunicator& comm, WireFormat wire, float* data, std::span<const Range> send_ranges, int dest,
              std::span<const Range> recv_ranges, int src, bool add);

// The power-of-two algorithms (recursive doubling, Rabenseifner) on any group size: the first 2*rem ranks
// fold in pairs (even sends its whole buffer to odd, which adds it), leaving pof2 ranks; after the algorithm
// the odd ones send the result back. new_rank: this rank among the pof2, -1 when folded away.
struct PowerOfTwoFold {
  int pof2 = 1, rem = 0, new_rank = -1;
  // The group rank of the rank that is `rank_new` among the pof2.
  int real_rank(int rank_new) const { return rank_new < rem ? rank_new * 2 + 1 : rank_new + rem; }
};
PowerOfTwoFold fold_to_power_of_two(MpiCommunicator& comm, WireFormat wire, float* data, size_t count);
void unfold_from_power_of_two(MpiCommunicator& comm, const PowerOfTwoFold& fold, WireFormat wire, float* data,
                              size_t count);

// Scratch slots used by the algorithms (slot 0 belongs to the dispatcher's bf16 working copy).
enum ScratchSlot : int { kScratchWork = 0, kScratchSend = 1, kScratchRecv = 2, kScratchExtra = 3 };

void allreduce_ring(MpiCommunicator& comm, float* data, size_t count, WireFormat wire);
void allreduce_recursive_doubling(MpiCommunicator& comm, float* data, size_t count, WireFormat wire);
void allreduce_rabenseifner(MpiCommunicator& comm, float* data, size_t count, WireFormat wire);
void allreduce_nhr(MpiCommunicator& comm, float* data, size_t count, WireFormat wire);
void allreduce_mesh(MpiCommunicator& comm, float* data, size_t count, WireFormat wire);
// The mesh's halves with any chunk per rank (owned[j]: rank j's; empty ones allowed): after the reduce-scatter
// rank r holds owned[r] summed over the group, after the all-gather every rank holds every owned chunk.
void mesh_reduce_scatter(MpiCommunicator& comm, float* data, std::span<const Range> owned, WireFormat wire);
void mesh_allgather(MpiCommunicator& comm, float* data, std::span<const Range> owned, WireFormat wire);
// Two levels (allreduce_hier.cc): reduce-scatter inside each host, `algo`'s flat algorithm between hosts on
// each slice, all-gather inside each host. algo: kHierRing .. kHierNhr.
void allreduce_hier(MpiCommunicator& comm, AllreduceAlgo algo, float* data, size_t count, WireFormat wire);
// A two-level collective's traffic and waits, counted on the levels' communicators, added to `comm`'s stats.
void add_level_stats(MpiCommunicator& comm, const MpiCommunicator& intra, const MpiCommunicator& inter);
void allreduce_shm(MpiCommunicator& comm, float* data, size_t count, WireFormat wire);
// fp32 sum over registered memory: `data` sits at `offset` in `window` on every rank (zero-copy, one pass:
// each rank sums its chunk from every buffer and stores the sum into every buffer).
void allreduce_shm_registered(MpiCommunicator& comm, ShmWindow& window, size_t offset, float* data, size_t count);
// Registered buffers at least this big take the zero-copy path (smaller ones: one-shot through the window).
size_t shm_zero_copy_min_bytes();
void allreduce_mpi(MpiCommunicator& comm, float* data, size_t count);

struct AlltoallArgs {
  const std::byte* send;
  std::span<const size_t> send_counts, send_offsets;  // elements
  std::byte* recv;
  std::span<const size_t> recv_counts, recv_offsets;  // elements
  size_t elem_bytes;
};
void alltoall_pairwise(MpiCommunicator& comm, const AlltoallArgs& args);
void alltoall_bruck(MpiCommunicator& comm, const AlltoallArgs& args);
void alltoall_mpi(MpiCommunicator& comm, const AlltoallArgs& args);
// Per-local-rank pairing across hosts (alltoall_hier.cc); pairwise on one host or a non-uniform map.
void alltoall_hier(MpiCommunicator& comm, const AlltoallArgs& args);

}  // namespace moex::comm::detail
