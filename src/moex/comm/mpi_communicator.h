// The MPI implementation of Communicator, plus what the algorithm files need from it: p2p with a watchdog,
// per-collective byte/wait counters, reusable scratch buffers and the node's shared-memory window.
// Internal to comm: nothing outside src/moex/comm includes this header.
#pragma once
// The C API only: OpenMPI's deprecated C++ bindings would need libmpi_cxx at link time.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <chrono>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moex/comm/codec.h"
#include "moex/comm/communicator.h"
#include "moex/comm/selector.h"

namespace moex::comm {

inline int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// What the running collective has done so far (reset at its start, read into its CollectiveEvent).
struct CollectiveStats {
  const char* operation = "";  // "allreduce(ring)": named in watchdog errors
  uint64_t bytes_sent = 0, bytes_received = 0;
  int64_t wait_ns = 0;
};

// [capacity] bytes per rank in one MPI-3 shared window over the ranks of a node, plus one flag per rank
// for barriers that never enter MPI (MPI_Barrier on oversubscribed ranks costs tens of microseconds).
class ShmWindow {
 public:
  ShmWindow(MPI_Comm node_comm, size_t capacity);  // collective over node_comm
  ~ShmWindow();
  ShmWindow(const ShmWindow&) = delete;
  ShmWindow& operator=(const ShmWindow&) = delete;

  size_t capacity() const { return capacity_; }
  std::byte* slot(int rank) const { return slots_[rank]; }  // [capacity] bytes, writable by every rank
  // All ranks of the node arrive before any leaves. Spins, then yields (oversubscribed ranks share cores).
  void barrier(CollectiveStats& stats);
  // Point-to-point flags for pipelined copies: rank raises its own counter; waits for a peer's.
  void post(uint64_t value);
  void wait_for(int peer, uint64_t value, CollectiveStats& stats);
  uint64_t next_epoch() { return ++epoch_; }
  // Alternates 0, 1, 0, ...: which half of each slot the next use writes (double buffering lets a rank
  // write the next message while a slow peer still reads the previous one, without another barrier).
  int next_half() { return static_cast<int>(uses_++ & 1); }
  uint64_t own_post() const { return *posts_[rank_]; }

 private:
  MPI_Win window_ = MPI_WIN_NULL;
  int rank_ = 0, size_ = 0;
  size_t capacity_ = 0;
  std::vector<std::byte*> slots_;
  std::vector<uint64_t*> flags_;  // flags_[j]: rank j's barrier counter (own cache line)
  std::vector<uint64_t*> posts_;  // posts_[j]: rank j's point-to-point counter
  uint64_t epoch_ = 0, uses_ = 0;
};

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (freed in the destructor unless it is MPI_COMM_WORLD). Collective.
  explicit MpiCommunicator(MPI_Comm comm);
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }
  std::unique_ptr<Communicator> split(int color, int key) override;
  void barrier() override;
  const Topology& topology() const override { return topology_; }

  P2PRequest isend(const void* data, size_t bytes, int peer, int tag) override;
  P2PRequest irecv(void* data, size_t bytes, int peer, int tag) override;
  void wait_all(std::span<P2PRequest> requests) override;
  bool test_all(std::span<P2PRequest> requests) override;

  void allreduce(void* data, size_t count, CommDType dtype, AllreduceAlgo algo) override;
  void alltoallv(const void* send, std::span<const size_t> send_counts, std::span<const size_t> send_offsets,
                 void* recv, std::span<const size_t> recv_counts, std::span<const size_t> recv_offsets,
                 size_t elem_bytes, AlltoallAlgo algo, std::optional<uint64_t> largest_block_bytes) override;
  void allgather(const void* send, size_t bytes, void* recv) override;
  void reduce_scatter(const void* send, void* recv, size_t count, CommDType dtype) override;
  void broadcast(void* data, size_t bytes, int root) override;
  CommHandle start(std::function<void(Communicator&)> op) override;
  void* alloc_registered(size_t bytes) override;
  void free_registered(void* buffer) override;

  // ---- for the algorithm files ----
  // The shared window holding [data, data + bytes) when it is registered memory (offset from the window's
  // start in *offset), else nullptr.
  ShmWindow* registered_window(const void* data, size_t bytes, size_t* offset) const;
  MPI_Comm mpi_comm() const { return comm_; }
  CollectiveStats& stats() { return stats_; }
  const CollectiveStats& stats_view() const { return stats_; }
  // A reusable buffer per slot: grows, never shrinks, so steady-state calls do not allocate.
  void* scratch(int slot, size_t bytes);
  // The hosts this group spans and the fewest ranks on one of them (what the selector needs).
  HostLevels host_levels() const;
  // True when every rank of this communicator shares one node (the shm algorithm is possible).
  bool all_on_one_node() const { return all_on_one_node_; }
  // The node window with at least `capacity` bytes per rank (re-created, collectively, when too small).
  ShmWindow& shm_window(size_t capacity);
  // Sends `send_bytes` to `dest` while receiving `recv_bytes` from `src`; counts bytes and wait time.
  void sendrecv(const void* send, size_t send_bytes, int dest, void* recv, size_t recv_bytes, int src);
  // Throws a comm error (exit 3) naming the MPI call when rc is not MPI_SUCCESS.
  void check(int rc, const char* call) const;
  // Waits for a non-blocking MPI collective under the watchdog of wait_all (MOEX_COMM_TIMEOUT): the engine's
  // small agreements (sizes, broadcasts, barriers) use MPI_I* so that a peer that stalls alive cannot hang them.
  void wait_collective(MPI_Request request);

 private:
  MPI_Comm comm_;
  MPI_Comm node_comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 0;
  bool all_on_one_node_ = false;
  CollectiveStats stats_;
  std::vector<std::vector<std::byte>> scratch_;
  std::unique_ptr<ShmWindow> shm_;
  std::vector<std::unique_ptr<ShmWindow>> registered_;          // alloc_registered on one node
  std::vector<std::unique_ptr<std::byte[]>> registered_plain_;  // alloc_registered across nodes
  std::unique_ptr<MpiCommunicator> async_twin_;  // MPI_Comm_dup'ed, driven by progress_
  std::unique_ptr<ProgressThread> progress_;
  Topology topology_;

  void find_topology();
  std::string pending_peers(std::span<const P2PRequest> requests, MPI_Request* handles) const;
};

// Marks that a comm error happened: finalize() then aborts the job instead of waiting for dead peers.
void mark_comm_failed();
// MPI_COMM_WORLD's private twin for abort_job (job.h); MPI_COMM_NULL until world() starts MPI.
MPI_Comm error_comm();
[[noreturn]] void throw_comm_error(const std::string& message);

}  // namespace moex::comm
