// All-to-all(v) entry point, and the other collectives the engine needs (all-gather, reduce-scatter,
// broadcast), each in its plainest good form.
#include <algorithm>
#include <cstring>

#include "moex/comm/algorithms.h"

namespace moex::comm {

void MpiCommunicator::alltoallv(const void* send, std::span<const size_t> send_counts,
                                std::span<const size_t> send_offsets, void* recv, std::span<const size_t> recv_counts,
                                std::span<const size_t> recv_offsets, size_t elem_bytes, AlltoallAlgo requested,
                                std::optional<uint64_t> largest_block_bytes) {
  MOEX_CHECK(send_counts.size() == static_cast<size_t>(size_) && recv_counts.size() == static_cast<size_t>(size_) &&
                 send_offsets.size() == static_cast<size_t>(size_) && recv_offsets.size() == static_cast<size_t>(size_),
             "alltoallv needs one count and offset per rank");
  uint64_t largest = 0, bytes_in = 0, largest_in = 0;
  for (size_t count : send_counts) {
    largest = std::max<uint64_t>(largest, count * elem_bytes);
    bytes_in += count * elem_bytes;
  }
  for (size_t count : recv_counts) largest_in = std::max<uint64_t>(largest_in, count * elem_bytes);
  // A declared figure below a block this rank sees is wrong on this rank at least; its peers may pick by it an
  // algorithm this rank would not, and the call would hang in mismatched messages. Refused before any message.
  if (largest_block_bytes && std::max(largest, largest_in) > *largest_block_bytes)
    throw_error(ErrorKind::kInternal,
                ::moex::detail::concat("alltoallv: the largest block passed (", *largest_block_bytes,
                                       " bytes) is smaller than one of rank ", rank_, "'s own (sends up to ", largest,
                                       " bytes, receives up to ", largest_in, ")"));
  AlltoallAlgo algo = requested;
  if (largest_block_bytes) {
    largest = *largest_block_bytes;  // the group's, known to the caller: nothing to agree on
  } else if (algo == AlltoallAlgo::kAuto && comm_options().alltoall_algo == AlltoallAlgo::kAuto && size_ > 1) {
    // Counts differ between ranks, so agree on the largest per-peer message before choosing (non-blocking,
    // so a peer that stalls here trips the watchdog instead of hanging the job).
    stats_ = CollectiveStats{"alltoall(agree sizes)"};
    MPI_Request request;
    check(MPI_Iallreduce(MPI_IN_PLACE, &largest, 1, MPI_UINT64_T, MPI_MAX, comm_, &request), "MPI_Iallreduce");
    wait_collective(request);
  }
  algo = select_alltoall(algo, size_, largest, host_levels());
  static thread_local std::string operation;
  operation = ::moex::detail::concat("alltoall(", algo_name(algo), ")");
  stats_ = CollectiveStats{operation.c_str()};
  const int64_t start = steady_now_ns();
  const detail::AlltoallArgs args{static_cast<const std::byte*>(send), send_counts, send_offsets,
                                  static_cast<std::byte*>(recv), recv_counts, recv_offsets, elem_bytes};
  switch (algo) {
    case AlltoallAlgo::kPairwise: detail::alltoall_pairwise(*this, args); break;
    case AlltoallAlgo::kBruck: detail::alltoall_bruck(*this, args); break;
    case AlltoallAlgo::kMpi: detail::alltoall_mpi(*this, args); break;
    case AlltoallAlgo::kHier: detail::alltoall_hier(*this, args); break;
    case AlltoallAlgo::kAuto: MOEX_CHECK(false, "auto was not resolved");
  }
  if (has_event_observer()) {
    notify_event(CollectiveEvent{Collective::kAlltoall, algo_name(algo), CommDType::kF32, size_, bytes_in,
                                 stats_.bytes_sent, stats_.bytes_received, start, steady_now_ns(), stats_.wait_ns});
  }
}

// Ring all-gather: p-1 steps, each forwarding the block received last step.
void MpiCommunicator::allgather(const void* send, size_t bytes, void* recv) {
  stats_ = CollectiveStats{"allgather(ring)"};
  const int64_t start = steady_now_ns();
  auto* out = static_cast<std::byte*>(recv);  // [size * bytes]
  if (send != out + rank_ * bytes) std::memmove(out + rank_ * bytes, send, bytes);
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  for (int step = 0; step < size_ - 1 && bytes > 0; ++step) {
    const int send_block = (rank_ - step + size_) % size_, recv_block = (rank_ - step - 1 + size_) % size_;
    sendrecv(out + send_block * bytes, bytes, next, out + recv_block * bytes, bytes, prev);
  }
  if (has_event_observer())
    notify_event(CollectiveEvent{Collective::kAllgather, "ring", CommDType::kF32, size_, bytes, stats_.bytes_sent,
                                 stats_.bytes_received, start, steady_now_ns(), stats_.wait_ns});
}

// Direct reduce-scatter (step s: my contribution to rank r+s), fp32 accumulation; each contribution is
// quantised once on lossy wires.
void MpiCommunicator::reduce_scatter(const void* send, void* recv, size_t count, CommDType dtype) {
  stats_ = CollectiveStats{"reduce_scatter(direct)"};
  const int64_t start = steady_now_ns();
  const WireFormat wire = wire_format_for(dtype);
  const size_t elem = comm_dtype_buffer_size(dtype);
  auto* acc = static_cast<float*>(scratch(detail::kScratchWork, count * 4 + 4));  // [count] fp32 sum
  auto* contribution = static_cast<float*>(scratch(detail::kScratchExtra, count * 4 + 4));  // [count]
  auto as_f32 = [&](int block, float* out) {  // my block `block` of send, as fp32
    const auto* bytes = static_cast<const std::byte*>(send) + block * count * elem;
    if (dtype == CommDType::kBF16) {
      bf16_to_f32_span(reinterpret_cast<const uint16_t*>(bytes), count, out);
    } else {
      std::memcpy(out, bytes, count * 4);
    }
  };
  as_f32(rank_, acc);
  const size_t wire_size = wire_bytes(wire, count);
  auto* send_staging = static_cast<std::byte*>(scratch(detail::kScratchSend, wire_size + 1));
  auto* recv_staging = static_cast<std::byte*>(scratch(detail::kScratchRecv, wire_size + 1));
  for (int step = 1; step < size_ && count > 0; ++step) {
    const int dest = (rank_ + step) % size_, src = (rank_ + size_ - step) % size_;
    as_f32(dest, contribution);
    wire_encode(wire, contribution, count, send_staging);
    sendrecv(send_staging, wire_size, dest, recv_staging, wire_size, src);
    wire_decode_add(wire, recv_staging, count, acc);
  }
  if (dtype == CommDType::kBF16) {
    f32_to_bf16_span(acc, count, static_cast<uint16_t*>(recv));
  } else {
    std::memcpy(recv, acc, count * 4);
  }
  if (has_event_observer())
    notify_event(CollectiveEvent{Collective::kReduceScatter, "direct", dtype, size_, size_ * count * elem,
                                 stats_.bytes_sent, stats_.bytes_received, start, steady_now_ns(), stats_.wait_ns});
}

void MpiCommunicator::broadcast(void* data, size_t bytes, int root) {
  stats_ = CollectiveStats{"broadcast(mpi)"};
  MOEX_CHECK(bytes <= static_cast<size_t>(INT32_MAX), "broadcast above 2 GiB");
  MPI_Request request;
  check(MPI_Ibcast(data, static_cast<int>(bytes), MPI_BYTE, root, comm_, &request), "MPI_Ibcast");
  wait_collective(request);
}

}  // namespace moex::comm
