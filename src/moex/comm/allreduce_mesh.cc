// Mesh two-shot: 2 steps, every peer at once. Reduce-scatter: each rank sends chunk j of its own buffer
// to rank j and sums the p-1 copies of its chunk it receives; all-gather: it sends its reduced chunk to
// every peer. Each contribution is quantised once, so lossy-wire error does not grow with p.
// The two halves take any chunk per rank (some may be empty): the hierarchical all-reduce runs them inside
// a host around its inter-host step.
#include <vector>

#include "moex/comm/algorithms.h"

namespace moex::comm::detail {
namespace {

// Byte offsets of each rank's chunk encoded on `wire`, one after another: [p + 1].
void encoded_offsets(WireFormat wire, std::span<const Range> owned, std::vector<size_t>& offsets) {
  offsets.assign(owned.size() + 1, 0);
  for (size_t j = 0; j < owned.size(); ++j) offsets[j + 1] = offsets[j] + wire_bytes(wire, owned[j].count);
}

}  // namespace

void mesh_reduce_scatter(MpiCommunicator& comm, float* data, std::span<const Range> owned, WireFormat wire) {
  const int p = comm.size(), r = comm.rank();
  const bool lossless = wire_is_lossless(wire);
  static thread_local std::vector<size_t> send_offsets;  // [p + 1] byte offsets of each encoded chunk
  encoded_offsets(wire, owned, send_offsets);
  const size_t mine_bytes = wire_bytes(wire, owned[r].count);
  // Staging: the send side holds every chunk encoded (lossy); the receive side p copies of my chunk.
  auto* send_staging = static_cast<std::byte*>(comm.scratch(kScratchSend, lossless ? 1 : send_offsets[p]));
  auto* recv_staging = static_cast<std::byte*>(comm.scratch(kScratchRecv, p * mine_bytes + 1));
  static thread_local std::vector<P2PRequest> requests;
  requests.clear();
  for (int j = 0; j < p; ++j)
    if (j != r && mine_bytes) requests.push_back(comm.irecv(recv_staging + j * mine_bytes, mine_bytes, j, 0));
  for (int j = 0; j < p; ++j) {
    if (j == r || owned[j].count == 0) continue;
    const float* chunk = data + owned[j].begin;
    const void* payload = chunk;
    if (!lossless) {
      wire_encode(wire, chunk, owned[j].count, send_staging + send_offsets[j]);
      payload = send_staging + send_offsets[j];
    }
    requests.push_back(comm.isend(payload, send_offsets[j + 1] - send_offsets[j], j, 0));
  }
  comm.wait_all(requests);
  requests.clear();
  float* mine = data + owned[r].begin;
  for (int j = 0; j < p; ++j)  // rank order: a fixed summation order
    if (j != r) wire_decode_add(wire, recv_staging + j * mine_bytes, owned[r].count, mine);
}

void mesh_allgather(MpiCommunicator& comm, float* data, std::span<const Range> owned, WireFormat wire) {
  const int p = comm.size(), r = comm.rank();
  const bool lossless = wire_is_lossless(wire);
  static thread_local std::vector<size_t> offsets;
  encoded_offsets(wire, owned, offsets);
  const size_t mine_bytes = wire_bytes(wire, owned[r].count);
  auto* staging = static_cast<std::byte*>(comm.scratch(kScratchSend, lossless ? 1 : offsets[p]));
  static thread_local std::vector<P2PRequest> requests;
  requests.clear();
  float* mine = data + owned[r].begin;
  const void* mine_payload = mine;
  if (!lossless) {  // what I keep is what the others decode
    wire_round_trip(wire, mine, owned[r].count);
    wire_encode(wire, mine, owned[r].count, staging + offsets[r]);
    mine_payload = staging + offsets[r];
  }
  for (int j = 0; j < p; ++j) {
    if (j == r || owned[j].count == 0) continue;
    void* target = lossless ? static_cast<void*>(data + owned[j].begin) : staging + offsets[j];
    requests.push_back(comm.irecv(target, offsets[j + 1] - offsets[j], j, 0));
  }
  for (int j = 0; j < p; ++j)
    if (j != r && mine_bytes) requests.push_back(comm.isend(mine_payload, mine_bytes, j, 0));
  comm.wait_all(requests);
  requests.clear();
  if (!lossless)
    for (int j = 0; j < p; ++j)
      if (j != r && owned[j].count) wire_decode(wire, staging + offsets[j], owned[j].count, data + owned[j].begin);
}

void allreduce_mesh(MpiCommunicator& comm, float* data, size_t count, WireFormat wire) {
  const int p = comm.size();
  const Partition chunks{count, wire_granule(wire), p};
  static thread_local std::vector<Range> owned;
  owned.resize(p);
  for (int j = 0; j < p; ++j) owned[j] = {chunks.begin(j), chunks.size(j)};
  mesh_reduce_scatter(comm, data, owned, wire);
  mesh_allgather(comm, data, owned, wire);
}

}  // namespace moex::comm::detail
