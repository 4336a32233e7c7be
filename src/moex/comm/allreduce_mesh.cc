// Mesh two-shot: 2 steps, every peer at once. Reduce-scatter: each rank sends chunk j of its own buffer
// to rank j and sums the p-1 copies of its chunk it receives; all-gather: it sends its reduced chunk to
// every peer. Each contribution is quantised once, so lossy-wire error does not grow with p.
#include <vector>

#include "moex/comm/algorithms.h"

namespace moex::comm::detail {

void allreduce_mesh(MpiCommunicator& comm, float* data, size_t count, WireFormat wire) {
  const int p = comm.size(), r = comm.rank();
  const Partition chunks{count, wire_granule(wire), p};
  const bool lossless = wire_is_lossless(wire);
  // Staging: send side holds every chunk encoded (lossy) - [wire_bytes of the whole buffer];
  // receive side holds p copies of my chunk - [p * wire_bytes(my chunk)].
  static thread_local std::vector<size_t> send_offsets;  // [p + 1] byte offsets of each encoded chunk
  send_offsets.assign(p + 1, 0);
  for (int j = 0; j < p; ++j) send_offsets[j + 1] = send_offsets[j] + wire_bytes(wire, chunks.size(j));
  const size_t mine_bytes = wire_bytes(wire, chunks.size(r));
  auto* send_staging = static_cast<std::byte*>(comm.scratch(kScratchSend, lossless ? 1 : send_offsets[p]));
  auto* recv_staging = static_cast<std::byte*>(comm.scratch(kScratchRecv, p * mine_bytes + 1));
  static thread_local std::vector<P2PRequest> requests;
  requests.clear();

  // Reduce-scatter: one message to and from every peer.
  for (int j = 0; j < p; ++j)
    if (j != r && mine_bytes) requests.push_back(comm.irecv(recv_staging + j * mine_bytes, mine_bytes, j, 0));
  for (int j = 0; j < p; ++j) {
    if (j == r || chunks.size(j) == 0) continue;
    const float* chunk = data + chunks.begin(j);
    const void* payload = chunk;
    if (!lossless) {
      wire_encode(wire, chunk, chunks.size(j), send_staging + send_offsets[j]);
      payload = send_staging + send_offsets[j];
    }
    requests.push_back(comm.isend(payload, send_offsets[j + 1] - send_offsets[j], j, 0));
  }
  comm.wait_all(requests);
  requests.clear();
  float* mine = data + chunks.begin(r);
  for (int j = 0; j < p; ++j)  // rank order: a fixed summation order
    if (j != r) wire_decode_add(wire, recv_staging + j * mine_bytes, chunks.size(r), mine);

  // All-gather: my reduced chunk to everyone, everyone's into place.
  const void* mine_payload = mine;
  if (!lossless) {
    wire_round_trip(wire, mine, chunks.size(r));
    wire_encode(wire, mine, chunks.size(r), send_staging + send_offsets[r]);
    mine_payload = send_staging + send_offsets[r];
  }
  for (int j = 0; j < p; ++j) {
    if (j == r || chunks.size(j) == 0) continue;
    void* target = lossless ? static_cast<void*>(data + chunks.begin(j)) : send_staging + send_offsets[j];
    requests.push_back(comm.irecv(target, send_offsets[j + 1] - send_offsets[j], j, 0));
  }
  for (int j = 0; j < p; ++j)
    if (j != r && mine_bytes) requests.push_back(comm.isend(mine_payload, mine_bytes, j, 0));
  comm.wait_all(requests);
  if (!lossless)
    for (int j = 0; j < p; ++j)
      if (j != r) wire_decode(wire, send_staging + send_offsets[j], chunks.size(j), data + chunks.begin(j));
}

}  // namespace moex::comm::detail
