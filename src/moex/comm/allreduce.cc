// All-reduce entry point: picks the algorithm, gives it an fp32 buffer (a working copy for bf16),
// reports the event. The shared exchange step used by the p2p algorithms lives here too.
#include <cstring>

#include "moex/base/error.h"
#include "moex/comm/algorithms.h"

namespace moex::comm {
namespace detail {

int cyclic_ranges(const Partition& partition, int first, int n, Range out[2]) {
  if (n <= 0) return 0;
  first %= partition.parts;
  if (first + n <= partition.parts) {
    out[0] = {partition.begin(first), partition.end(first + n - 1) - partition.begin(first)};
    return 1;
  }
  out[0] = {partition.begin(first), partition.count - partition.begin(first)};
  out[1] = {0, partition.end(first + n - partition.parts - 1)};
  return 2;
}

void exchange(MpiCommunicator& comm, WireFormat wire, float* data, std::span<const Range> send_ranges, int dest,
              std::span<const Range> recv_ranges, int src, bool add) {
  P2PRequest requests[6];
  int n = 0;
  size_t recv_count = 0, send_count = 0;
  for (const Range& range : recv_ranges) recv_count += range.count;
  for (const Range& range : send_ranges) send_count += range.count;
  std::byte* recv_staging = nullptr;
  if (src >= 0 && recv_count > 0) {
    if (wire == WireFormat::kF32) {  // one message per range, as the sender sends them
      if (add) recv_staging = static_cast<std::byte*>(comm.scratch(kScratchRecv, recv_count * 4));
      size_t staged = 0;
      for (const Range& range : recv_ranges) {
        if (!range.count) continue;
        // A copy lands where it belongs (no staging); a sum lands beside the buffer, then is added.
        void* target = add ? static_cast<void*>(recv_staging + staged * 4) : data + range.begin;
        requests[n++] = comm.irecv(target, range.count * 4, src, 0);
        staged += range.count;
      }
    } else {
      size_t bytes = 0;
      for (const Range& range : recv_ranges) bytes += wire_bytes(wire, range.count);
      recv_staging = static_cast<std::byte*>(comm.scratch(kScratchRecv, bytes));
      requests[n++] = comm.irecv(recv_staging, bytes, src, 0);
    }
  }
  if (dest >= 0 && send_count > 0) {
    if (wire == WireFormat::kF32) {  // straight from the buffer
      for (const Range& range : send_ranges)
        if (range.count) requests[n++] = comm.isend(data + range.begin, range.count * 4, dest, 0);
    } else {
      size_t bytes = 0;
      for (const Range& range : send_ranges) bytes += wire_bytes(wire, range.count);
      auto* staging = static_cast<std::byte*>(comm.scratch(kScratchSend, bytes));
      std::byte* cursor = staging;
      for (const Range& range : send_ranges) {  // each range encoded on its own: blocks start at range edges
        wire_encode(wire, data + range.begin, range.count, cursor);
        cursor += wire_bytes(wire, range.count);
      }
      requests[n++] = comm.isend(staging, bytes, dest, 0);
    }
  }
  comm.wait_all({requests, static_cast<size_t>(n)});
  if (!recv_staging) return;
  const std::byte* cursor = recv_staging;
  for (const Range& range : recv_ranges) {
    if (add) {
      wire_decode_add(wire, cursor, range.count, data + range.begin);
    } else {
      wire_decode(wire, cursor, range.count, data + range.begin);
    }
    cursor += wire_bytes(wire, range.count);
  }
}

PowerOfTwoFold fold_to_power_of_two(MpiCommunicator& comm, WireFormat wire, float* data, size_t count) {
  const int p = comm.size(), r = comm.rank();
  PowerOfTwoFold fold;
  while (fold.pof2 * 2 <= p) fold.pof2 *= 2;
  fold.rem = p - fold.pof2;
  const Range all{0, count};
  const std::span<const Range> whole{&all, 1}, none{};
  if (r >= 2 * fold.rem) {
    fold.new_rank = r - fold.rem;
  } else if (r % 2 == 0) {
    exchange(comm, wire, data, whole, r + 1, none, -1, true);
  } else {
    exchange(comm, wire, data, none, -1, whole, r - 1, true);
    fold.new_rank = r / 2;
  }
  return fold;
}

void unfold_from_power_of_two(MpiCommunicator& comm, const PowerOfTwoFold& fold, WireFormat wire, float* data,
                              size_t count) {
  const int r = comm.rank();
  if (r >= 2 * fold.rem) return;
  const Range all{0, count};
  const std::span<const Range> whole{&all, 1}, none{};
  if (r % 2 == 1) {
    exchange(comm, wire, data, whole, r - 1, none, -1, false);
  } else {
    exchange(comm, wire, data, none, -1, whole, r + 1, false);
  }
}

}  // namespace detail

void MpiCommunicator::allreduce(void* data, size_t count, CommDType dtype, AllreduceAlgo requested) {
  const size_t buffer_bytes = count * comm_dtype_buffer_size(dtype);
  size_t registered_offset = 0;
  ShmWindow* registered = dtype == CommDType::kF32 && !registered_.empty()
                              ? registered_window(data, buffer_bytes, &registered_offset)
                              : nullptr;
  const AllreduceAlgo algo = select_allreduce(requested, size_, dtype, buffer_bytes, all_on_one_node_,
                                              registered != nullptr, host_levels());
  // Asked for by name (flag, MOEX_COMM_ALGO, a caller): every rank of the group knows, so all fail alike.
  if (algo == AllreduceAlgo::kShm && !all_on_one_node_)
    throw_error(ErrorKind::kInvalidInput,
                ::moex::detail::concat("the shm all-reduce needs every rank on one host; this group of ", size_,
                                       " ranks spans ", topology_.hosts(), " hosts: choose another algorithm"));
  static constexpr const char* kOperation[] = {"allreduce(auto)", "allreduce(ring)", "allreduce(rd)",
                                               "allreduce(rabenseifner)", "allreduce(nhr)", "allreduce(mesh)",
                                               "allreduce(shm)", "allreduce(mpi)", "allreduce(hier)",
                                               "allreduce(hier-ring)", "allreduce(hier-rd)",
                                               "allreduce(hier-rabenseifner)", "allreduce(hier-nhr)"};  // AllreduceAlgo order
  stats_ = CollectiveStats{kOperation[static_cast<int>(algo)]};
  const int64_t start = steady_now_ns();
  bool zero_copy = false;
  if (size_ > 1 && count > 0) {
    float* work = static_cast<float*>(data);
    if (dtype == CommDType::kBF16) {  // accumulate in fp32: a working copy, converted back at the end
      work = static_cast<float*>(scratch(detail::kScratchWork, count * 4));
      bf16_to_f32_span(static_cast<const uint16_t*>(data), count, work);
    }
    const WireFormat wire = wire_format_for(dtype);
    switch (algo) {
      case AllreduceAlgo::kRing: detail::allreduce_ring(*this, work, count, wire); break;
      case AllreduceAlgo::kRecursiveDoubling: detail::allreduce_recursive_doubling(*this, work, count, wire); break;
      case AllreduceAlgo::kRabenseifner: detail::allreduce_rabenseifner(*this, work, count, wire); break;
      case AllreduceAlgo::kNhr: detail::allreduce_nhr(*this, work, count, wire); break;
      case AllreduceAlgo::kMesh: detail::allreduce_mesh(*this, work, count, wire); break;
      case AllreduceAlgo::kShm:
        zero_copy = registered && buffer_bytes >= detail::shm_zero_copy_min_bytes();
        if (zero_copy) detail::allreduce_shm_registered(*this, *registered, registered_offset, work, count);
        else detail::allreduce_shm(*this, work, count, wire);
        break;
      case AllreduceAlgo::kMpi: detail::allreduce_mpi(*this, work, count); break;
      case AllreduceAlgo::kHierRing:
      case AllreduceAlgo::kHierRecursiveDoubling:
      case AllreduceAlgo::kHierRabenseifner:
      case AllreduceAlgo::kHierNhr: detail::allreduce_hier(*this, algo, work, count, wire); break;
      case AllreduceAlgo::kAuto:
      case AllreduceAlgo::kHier: MOEX_CHECK(false, algo_name(algo), " was not resolved");
    }
    if (dtype == CommDType::kBF16) f32_to_bf16_span(work, count, static_cast<uint16_t*>(data));
  }
  const int64_t end = steady_now_ns();
  if (has_event_observer()) {
    notify_event(CollectiveEvent{Collective::kAllreduce, zero_copy ? "shm-registered" : algo_name(algo), dtype, size_,
                                 buffer_bytes, stats_.bytes_sent, stats_.bytes_received, start, end, stats_.wait_ns});
  }
}

}  // namespace moex::comm
