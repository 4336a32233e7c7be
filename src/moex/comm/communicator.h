// Communicator: the only way the engine talks to other ranks. A group of ranks (the world, or a TP/EP
// sub-group made by split()) with collectives, point-to-point, and non-blocking handles for overlap.
// MpiCommunicator implements it over MPI; a rank launched without mpirun gets a size-1 SelfCommunicator
// that never touches MPI (fast start, no orted). A future accelerator backend implements the same class.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "moex/comm/async.h"
#include "moex/comm/topology.h"
#include "moex/comm/types.h"

namespace moex::comm {

// One outstanding point-to-point transfer; opaque so this header does not need mpi.h.
struct P2PRequest {
  uint64_t opaque = 0;
  int peer = -1;  // the group rank at the other end (-1: a collective's): a wait that times out names its host
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend() const = 0;  // "mpi", "self"

  // Ranks passing the same color form one new communicator, ordered by key then by old rank. Collective.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  virtual void barrier() = 0;

  // ---- topology ----
  // Which ranks of this group share a host (topology.h); known from construction, so this never communicates.
  virtual const Topology& topology() const = 0;
  // The two levels of a hierarchical collective, made together on the first call of either. That first
  // call is collective, as split() is: every rank of the group makes it at the same point.
  // intra_host(): the group's ranks on this rank's host, in rank order (level 0: shared memory).
  // inter_host(): the ranks with this rank's local index (Topology::local_rank), one per host, in host
  // order (level 1: the network). On a non-uniform topology some inter-host groups miss some hosts.
  Communicator& intra_host();
  Communicator& inter_host();

  // ---- point to point (bytes) ----
  virtual P2PRequest isend(const void* data, size_t bytes, int peer, int tag) = 0;
  virtual P2PRequest irecv(void* data, size_t bytes, int peer, int tag) = 0;
  // Blocks until all complete; a peer that makes no progress for the comm timeout is an error (exit 3).
  virtual void wait_all(std::span<P2PRequest> requests) = 0;
  // Never blocks: true when all have completed (they are then released), else nothing changes. For a
  // waiter that sleeps between tests instead of spinning (an idle `moex serve` rank, runtime/step_protocol).
  virtual bool test_all(std::span<P2PRequest> requests) = 0;

  // ---- collectives (blocking; every rank of the group calls them in the same order) ----
  // data [count] of dtype (fp32 for kF32/kF8, uint16_t bf16 for kBF16); in place, sum.
  virtual void allreduce(void* data, size_t count, CommDType dtype, AllreduceAlgo algo = AllreduceAlgo::kAuto) = 0;
  // Uneven all-to-all: rank r sends send_counts[j] elements from send + send_offsets[j] to rank j, and
  // receives recv_counts[j] elements into recv + recv_offsets[j]. Counts and offsets in elements.
  // `auto` picks the algorithm by the largest block any rank of the group sends, so every rank must pick by the
  // same figure: without `largest_block_bytes` the ranks first agree on it (an 8-byte all-reduce, one more
  // collective). A caller that already knows it passes it and no agreement runs: the same value on every rank, at
  // least every rank's largest send_counts[j] x elem_bytes (its own block included). A rank with a block of its own
  // (sent or received) above the value throws before anything moves: a smaller value than the truth on some ranks
  // would let them pick another algorithm than their peers and hang. A value that differs between ranks but is
  // above every block cannot be seen locally; the caller owns that (derive it from data every rank holds).
  virtual void alltoallv(const void* send, std::span<const size_t> send_counts,
                         std::span<const size_t> send_offsets, void* recv, std::span<const size_t> recv_counts,
                         std::span<const size_t> recv_offsets, size_t elem_bytes,
                         AlltoallAlgo algo = AlltoallAlgo::kAuto,
                         std::optional<uint64_t> largest_block_bytes = std::nullopt) = 0;
  // send [bytes] from every rank -> recv [size() * bytes], rank order.
  virtual void allgather(const void* send, size_t bytes, void* recv) = 0;
  // send [size() * count] of dtype -> recv [count]: this rank's slice of the sum.
  virtual void reduce_scatter(const void* send, void* recv, size_t count, CommDType dtype) = 0;
  // data [bytes] from root to all.
  virtual void broadcast(void* data, size_t bytes, int root) = 0;

  // ---- registered memory (like NCCL's ncclMemAlloc + buffer registration) ----
  // Collective: `bytes` of memory that every rank of this group can read directly — a slice of an MPI-3
  // shared window when all ranks share a node, else ordinary memory. An fp32 all-reduce on registered
  // memory, at the same offset on every rank, lets the shm algorithm sum and store straight into the peers'
  // buffers instead of copying them through its window (zero-copy, one pass). Kept until free_registered or destruction.
  virtual void* alloc_registered(size_t bytes) = 0;
  virtual void free_registered(void* buffer) = 0;  // collective

  // ---- overlap ----
  // Runs `op` on this group's progress thread, against a private twin of this communicator (its own MPI
  // context, so it never mixes with blocking calls made meanwhile). Every rank must start the same ops in
  // the same order. The buffers `op` touches must stay alive and untouched until the handle is waited on.
  virtual CommHandle start(std::function<void(Communicator&)> op) = 0;

  CommHandle start_allreduce(void* data, size_t count, CommDType dtype, AllreduceAlgo algo = AllreduceAlgo::kAuto);

 private:
  void make_host_levels();
  std::unique_ptr<Communicator> intra_host_, inter_host_;
};

// Sums fp32 activations over the group with `wire` as the payload type: fp32 and fp8 take the fp32 buffer
// as it is; bf16 goes through `bf16_scratch` (grown as needed). What the engine calls after a TP matmul.
void allreduce_f32(Communicator& comm, float* data, size_t count, CommDType wire, std::vector<uint16_t>& bf16_scratch);

// alltoallv_f32's encoded buffers and per-peer byte counts, kept by the caller from call to call (grown, never
// shrunk: a step allocates nothing once they have seen its size).
struct WireScratch {
  std::vector<uint8_t> send, recv;
  std::vector<size_t> send_bytes, send_offsets, recv_bytes, recv_offsets;  // [size()] on the wire
};
// Uneven all-to-all of fp32 values with `wire` as the payload type: this rank sends send_counts[j] values from
// send + send_offsets[j] to rank j and receives recv_counts[j] values into recv + recv_offsets[j] (counts and offsets
// in values). Each peer's block is encoded once, from its own start (codec.h: fp8's 128-value blocks), and decoded
// where it lands. What the MoE dispatch path sends its rows and their expert outputs with. `largest_block_values`:
// as alltoallv's largest_block_bytes, in fp32 values (the largest send_counts[j] over the group), so that no
// agreement runs; the wire bytes of that many values are what the algorithm is picked by.
void alltoallv_f32(Communicator& comm, const float* send, std::span<const size_t> send_counts,
                   std::span<const size_t> send_offsets, float* recv, std::span<const size_t> recv_counts,
                   std::span<const size_t> recv_offsets, CommDType wire, WireScratch& scratch,
                   std::optional<size_t> largest_block_values = std::nullopt);

// The world, created on first use (MPI_Init_thread with MPI_THREAD_MULTIPLE when launched by mpirun).
// MOEX_COMM_FORCE_MPI=1 uses MPI even without a launcher (an OpenMPI singleton).
Communicator& world();
// Explicit start-up (optional): same as world(); returns it.
Communicator& init();
// Finalizes MPI if it was started (also registered with atexit). After a comm error it aborts the job
// instead, so peers stuck in a collective are killed rather than left waiting.
void finalize();
// True when this process was started by mpirun/srun (a PMI/PMIx rank variable is set).
bool launched_by_mpi_launcher();

// Seconds a wait may go without progress before it is an error: MOEX_COMM_TIMEOUT (default 60).
double comm_timeout_seconds();
void set_comm_timeout_seconds(double seconds);

}  // namespace moex::comm
