// Shared-memory all-reduce for ranks on one node, through an MPI-3 shared window (MPI_Win_allocate_shared
// on the MPI_COMM_TYPE_SHARED communicator) and flag barriers that never enter MPI.
//  - one-shot (small): every rank writes its buffer into its slot; after one barrier every rank sums all
//    slots in rank order (so all ranks get bit-identical sums). Latency: one barrier.
//  - two-shot (large), in segments that stay cache-resident: each rank writes the chunks other ranks own,
//    barrier, reduces its own chunk from every slot and publishes it, barrier, copies the others' chunks.
//    Per rank this moves ~2(p-1)n/p bytes through the window instead of one-shot's p*n reads.
// Each slot has two halves used alternately, so no barrier is needed at the end of a step.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "moex/base/cpu.h"
#include "moex/comm/algorithms.h"
#include "moex/comm/shm_copy.h"
#include "moex/comm/x86/memory_avx512.h"

namespace moex::comm {
namespace detail {
namespace {

size_t env_bytes(const char* name, size_t fallback) {
  const char* text = std::getenv(name);
  return text && *text ? std::strtoull(text, nullptr, 10) : fallback;
}

// Below this many buffer bytes, one-shot (1 barrier, p*n reads) beats two-shot (2 barriers per segment).
size_t one_shot_max_bytes() {
  static const size_t bytes = env_bytes("MOEX_SHM_ONESHOT_BYTES", 64 << 10);
  return bytes;
}
// Two-shot segment: small enough that what one rank writes is still in cache when its peers read it.
size_t segment_elems() {
  static const size_t elems = std::max<size_t>(env_bytes("MOEX_SHM_SEGMENT_BYTES", 1 << 20) / 4, kF8BlockElems);
  return elems / kF8BlockElems * kF8BlockElems;
}

// fp32 buffers from this size up are written by the copies out with non-temporal stores: they exceed the
// caches and are not read again inside the call (MOEX_SHM_STREAM_BYTES; 0 = never).
const size_t kStreamingMinBytes = [] {
  const size_t bytes = env_bytes("MOEX_SHM_STREAM_BYTES", 1 << 20);
  return bytes == 0 ? SIZE_MAX : bytes;
}();

bool have_avx512() {
  static const bool yes = use_x86_kernels() && cpu_features().avx512f;
  return yes;
}

void encode_into(WireFormat wire, const float* src, size_t count, std::byte* dst) {
  wire_encode(wire, src, count, dst);  // for f32 this is the memcpy into the window
}

void one_shot(MpiCommunicator& comm, float* data, size_t count, WireFormat wire) {
  const int p = comm.size(), r = comm.rank();
  const size_t bytes = wire_bytes(wire, count);
  ShmWindow& window = comm.shm_window(2 * bytes);
  const size_t half_offset = window.next_half() * (window.capacity() / 2);
  auto& stats = comm.stats();
  encode_into(wire, data, count, window.slot(r) + half_offset);
  stats.bytes_sent += bytes;
  window.barrier(stats);
  wire_decode(wire, window.slot(0) + half_offset, count, data);
  for (int j = 1; j < p; ++j) wire_decode_add(wire, window.slot(j) + half_offset, count, data);
  stats.bytes_received += (p - 1) * bytes;
}

void two_shot(MpiCommunicator& comm, float* data, size_t count, WireFormat wire) {
  const int p = comm.size(), r = comm.rank();
  const size_t segment = segment_elems();
  const size_t segment_bytes = wire_bytes(wire, segment) + p * 4 * 2;  // + per-chunk partial-block scales
  ShmWindow& window = comm.shm_window(2 * segment_bytes);
  auto& stats = comm.stats();
  const bool lossless = wire_is_lossless(wire);
  // fp32 into a buffer beyond the caches: the copies out use streaming stores.
  const bool stream_out = lossless && count * 4 >= kStreamingMinBytes && have_avx512();
  for (size_t base = 0; base < count; base += segment) {
    const size_t n = std::min(segment, count - base);
    float* values = data + base;  // [n]
    const Partition chunks{n, wire_granule(wire), p};
    // Chunk j sits in every slot at the same offset: where its encoded bytes start.
    auto offset_of = [&](int j) { return wire_bytes(wire, chunks.begin(j)); };  // chunks start on block edges
    const size_t half_offset = window.next_half() * (window.capacity() / 2);
    std::byte* own = window.slot(r) + half_offset;
    for (int j = 0; j < p; ++j) {
      if (j == r) continue;
      encode_into(wire, values + chunks.begin(j), chunks.size(j), own + offset_of(j));
      stats.bytes_sent += wire_bytes(wire, chunks.size(j));
    }
    window.barrier(stats);
    float* mine = values + chunks.begin(r);
    const int last_peer = r == p - 1 ? p - 2 : p - 1;
    for (int j = 0; j < p; ++j) {
      if (j == r) continue;
      const std::byte* peer = window.slot(j) + half_offset + offset_of(r);
      if (lossless && j == last_peer) {  // fp32: the last add also publishes the sum into the window
        add_f32_publish(reinterpret_cast<const float*>(peer), chunks.size(r), mine,
                        reinterpret_cast<float*>(own + offset_of(r)));
      } else {
        wire_decode_add(wire, peer, chunks.size(r), mine);
      }
      stats.bytes_received += wire_bytes(wire, chunks.size(r));
    }
    if (!lossless) {
      wire_round_trip(wire, mine, chunks.size(r));
      encode_into(wire, mine, chunks.size(r), own + offset_of(r));
    }
    stats.bytes_sent += wire_bytes(wire, chunks.size(r));
    window.barrier(stats);
    for (int j = 0; j < p; ++j) {
      if (j == r) continue;
      const std::byte* piece = window.slot(j) + half_offset + offset_of(j);
      if (stream_out) {
        x86::copy_f32_streaming(values + chunks.begin(j), reinterpret_cast<const float*>(piece), chunks.size(j));
      } else {
        wire_decode(wire, piece, chunks.size(j), values + chunks.begin(j));
      }
      stats.bytes_received += wire_bytes(wire, chunks.size(j));
    }
  }
}

}  // namespace


// Registered buffers of this size and up take the zero-copy path (two barriers, no copies); below it the
// one-shot's single barrier wins (measured crossover at 2 ranks: 1-2 KB).
size_t shm_zero_copy_min_bytes() {
  static const size_t bytes = env_bytes("MOEX_SHM_ZERO_COPY_BYTES", 2048);
  return bytes;
}

// Zero-copy, one pass: every rank's buffer is already in the shared window, so nothing is copied in and
// there is no separate all-gather. Rank r owns chunk r: it reads chunk r from every rank's buffer, sums in
// rank order, and stores the sum straight back into chunk r of every buffer (the reduce-scatter and the
// all-gather fused, like NVLink SHARP's load-reduce + multicast store, done by the owning core). No rank
// reads or writes another's chunk, so the only synchronisation is a barrier before (all inputs complete)
// and after (all sums stored, so no caller sees its buffer before it is final or overwrites it while a
// peer still reads). Per rank: n bytes read and n written -- the traffic of a plain copy, where a two-shot
// (sum own chunk, barrier, copy the others) moves 1.5n read + n written.
void allreduce_shm_registered(MpiCommunicator& comm, ShmWindow& window, size_t offset, float* data, size_t count) {
  const int p = comm.size(), r = comm.rank();
  auto& stats = comm.stats();
  const Partition chunks{count, 16, p};  // 64-byte granules: no two ranks write one cache line
  const size_t begin = chunks.begin(r), n = chunks.size(r);
  // Every rank's buffer at the same offset of its slot (data is this rank's). Reused: decode-sized
  // all-reduces take this path once per layer, and must not allocate.
  thread_local std::vector<float*> buffers;
  buffers.resize(p);
  for (int j = 0; j < p; ++j) buffers[j] = j == r ? data : reinterpret_cast<float*>(window.slot(j) + offset);
  window.barrier(stats);  // every rank's input is complete
  // Large buffers: streaming stores, since the results go back to memory anyway and nothing reads them
  // inside the call; below that the lines stay in cache for the caller.
  const bool stream = count * 4 >= kStreamingMinBytes;
  if (have_avx512()) x86::sum_to_all_f32(buffers.data(), p, begin, begin + n, stream);
  else sum_to_all_f32(buffers.data(), p, begin, begin + n);
  stats.bytes_received += (p - 1) * n * 4;  // chunk r read from every peer
  stats.bytes_sent += (p - 1) * n * 4;      // and its sum stored into every peer's buffer
  window.barrier(stats);
}

void allreduce_shm(MpiCommunicator& comm, float* data, size_t count, WireFormat wire) {
  if (count * 4 <= one_shot_max_bytes()) {
    one_shot(comm, data, count, wire);
  } else {
    two_shot(comm, data, count, wire);
  }
}

}  // namespace detail

bool can_copy_through_shm(Communicator& comm) {
  auto* mpi = dynamic_cast<MpiCommunicator*>(&comm);
  return mpi && mpi->size() >= 2 && mpi->all_on_one_node();
}

void copy_through_shm(Communicator& group, const std::byte* source, std::byte* target, size_t bytes,
                      size_t chunk_bytes, bool streaming) {
  if (bytes == 0 || !can_copy_through_shm(group)) return;
  auto& comm = static_cast<MpiCommunicator&>(group);
  const int r = comm.rank();
  const size_t chunk = std::min<size_t>(std::max<size_t>(chunk_bytes, 4096), bytes);
  ShmWindow& window = comm.shm_window(2 * chunk);  // every rank: growing the window is collective
  if (r > 1) return;
  CollectiveStats stats{"copy"};
  const uint64_t base = window.own_post();  // ranks 0 and 1 post equally often, so their counters agree
  const size_t chunks = (bytes + chunk - 1) / chunk;
  for (size_t i = 0; i < chunks; ++i) {
    const size_t offset = i * chunk, n = std::min(chunk, bytes - offset);
    std::byte* buffer = window.slot(0) + (i & 1) * chunk;
    if (r == 0) {
      if (i >= 2) window.wait_for(1, base + i - 1, stats);  // rank 1 has drained this buffer
      std::memcpy(buffer, source + offset, n);
      window.post(base + i + 1);
    } else {
      window.wait_for(0, base + i + 1, stats);
      if (streaming && n % 4 == 0) {
        x86::copy_f32_streaming(reinterpret_cast<float*>(target + offset), reinterpret_cast<const float*>(buffer), n / 4);
      } else {
        std::memcpy(target + offset, buffer, n);
      }
      window.post(base + i + 1);
    }
  }
  if (r == 0) window.wait_for(1, base + chunks, stats);  // the copy is done when rank 1 has it
}

CopyBandwidth measure_copy_through_shm(Communicator& group, size_t bytes, int iters) {
  if (!can_copy_through_shm(group)) return {};
  auto& comm = static_cast<MpiCommunicator&>(group);
  const int r = comm.rank();
  auto* source = static_cast<std::byte*>(comm.scratch(detail::kScratchSend, bytes));  // [bytes] rank 0's private data
  auto* target = static_cast<std::byte*>(comm.scratch(detail::kScratchRecv, bytes));  // [bytes] rank 1's private copy
  std::memset(r == 0 ? source : target, r, bytes);
  CollectiveStats stats{"copy-bandwidth"};
  CopyBandwidth best;
  // The pipeline's chunk decides where the handoff lives (L2 for small chunks, L3/DRAM for large), and
  // streaming stores may speed the copy out: take the best, so the reference is the fastest copy this
  // method makes, not an arbitrary one.
  const bool can_stream = detail::have_avx512();
  for (int streaming = 0; streaming <= (can_stream ? 1 : 0); ++streaming) {
    for (size_t chunk = 64 << 10; chunk <= (4u << 20); chunk *= 2) {
      double best_s = 1e30;
      for (int iter = 0; iter < iters; ++iter) {
        comm.shm_window(2 * std::min(chunk, bytes)).barrier(stats);
        const int64_t start = steady_now_ns();
        copy_through_shm(comm, source, target, bytes, chunk, streaming);
        if (r <= 1) best_s = std::min(best_s, (steady_now_ns() - start) * 1e-9);
      }
      comm.shm_window(0).barrier(stats);
      double seconds = r == 0 ? best_s : 0.0;
      MPI_Bcast(&seconds, 1, MPI_DOUBLE, 0, comm.mpi_comm());
      if (bytes / seconds > best.bytes_per_second) best = {bytes / seconds, chunk, streaming == 1};
    }
  }
  return best;
}

}  // namespace moex::comm
