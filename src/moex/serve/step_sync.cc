#include "moex/serve/step_sync.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <thread>

#include "moex/base/error.h"

namespace moex::serve {
namespace {
constexpr int kRoot = 0;
// {command, num_tokens, num_seqs, num_logit_rows (-1: every row), table entries}
using Header = std::array<int64_t, 5>;
constexpr int kHeaderTag = 7301;  // the header's point-to-point messages (nothing else on this tag)
constexpr int kArrayTag = 7302;   // attention DP: a sub-step's arrays, rank 0 -> rank r
constexpr int kLogitsTag = 7303;  // attention DP: a sub-step's logit rows, rank r -> rank 0

bool data_parallel(const DecoderModel& model) {
  const ParallelPlan& plan = model.options().plan;
  return plan.attn == AttnParallel::kDP && !plan.single();
}

// The header goes point to point, not by broadcast: a waiting rank tests for it and sleeps in between
// (receive_header), where MPI_Bcast would spin a core for as long as the server is idle. headers[r] goes to
// rank r (headers[0] is not sent).
void send_headers(comm::Communicator& comm, const Header* headers) {
  std::vector<comm::P2PRequest> sends;
  for (int r = 0; r < comm.size(); ++r)
    if (r != kRoot) sends.push_back(comm.isend(headers[r].data(), sizeof(Header), r, kHeaderTag));
  comm.wait_all(sends);
}

// Tests for the header, spinning ~1 ms (a busy server's next step comes sooner), then sleeping 50 us
// growing to 1 ms between tests. Rank 0's idle heartbeat (100 ms) comes well within the comm timeout.
void receive_header(comm::Communicator& comm, Header& h) {
  comm::P2PRequest request = comm.irecv(h.data(), sizeof(Header), kRoot, kHeaderTag);
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto limit = std::chrono::duration<double>(comm::comm_timeout_seconds());
  auto sleep = std::chrono::microseconds(50);
  for (uint64_t tests = 0; !comm.test_all({&request, 1}); ++tests) {
    const auto waited = Clock::now() - start;
    if (waited >= limit)  // rank 0 is gone or stuck: a comm failure (exit 3), as a collective's timeout
      throw_error(ErrorKind::kComm, detail::concat("moex serve: rank ", comm.rank(), " heard nothing from rank 0 for ",
                                                   comm::comm_timeout_seconds(), " s (MOEX_COMM_TIMEOUT)"));
    if (waited < std::chrono::milliseconds(1)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(sleep);
      sleep = std::min<std::chrono::microseconds>(sleep * 2, std::chrono::milliseconds(1));
    }
  }
}

Header header_of(const StepInput& step) {
  int64_t entries = 0;
  for (int64_t s = 0; s < step.num_seqs; ++s) entries += step.seqs[s].num_blocks;
  return {static_cast<int64_t>(StepCommand::kStep), step.num_tokens, step.num_seqs,
          step.logit_rows ? step.num_logit_rows : -1, entries};
}

// Per sequence {pos, len, table size}, and the tables end to end. Small steps: a few copies are cheaper than
// a message per table.
void pack(const StepInput& step, std::vector<int64_t>& meta, std::vector<int32_t>& tables) {
  meta.resize(static_cast<size_t>(3 * step.num_seqs));
  tables.clear();
  for (int64_t s = 0; s < step.num_seqs; ++s) {
    const StepSeq& q = step.seqs[s];
    meta[3 * s] = q.pos, meta[3 * s + 1] = q.len, meta[3 * s + 2] = q.num_blocks;
    tables.insert(tables.end(), q.block_table, q.block_table + q.num_blocks);
  }
}

// Point to point, skipping empty arrays (both sides know every size from the header).
void isend_array(comm::Communicator& comm, std::vector<comm::P2PRequest>& requests, const void* data, size_t bytes,
                 int peer) {
  if (bytes > 0) requests.push_back(comm.isend(data, bytes, peer, kArrayTag));
}
void irecv_array(comm::Communicator& comm, std::vector<comm::P2PRequest>& requests, void* data, size_t bytes) {
  if (bytes > 0) requests.push_back(comm.irecv(data, bytes, kRoot, kArrayTag));
}
}  // namespace

void send_command(comm::Communicator& comm, StepCommand command) {
  std::vector<Header> h(static_cast<size_t>(comm.size()), Header{static_cast<int64_t>(command), 0, 0, 0, 0});
  send_headers(comm, h.data());
}

void send_step(comm::Communicator& comm, const StepInput& step) {
  std::vector<Header> h(static_cast<size_t>(comm.size()), header_of(step));
  send_headers(comm, h.data());
  std::vector<int64_t> meta;
  std::vector<int32_t> tables;
  pack(step, meta, tables);
  comm.broadcast(const_cast<int32_t*>(step.tokens), static_cast<size_t>(step.num_tokens) * sizeof(int32_t), kRoot);
  comm.broadcast(meta.data(), meta.size() * sizeof(int64_t), kRoot);
  comm.broadcast(tables.data(), tables.size() * sizeof(int32_t), kRoot);
  if (step.logit_rows)
    comm.broadcast(const_cast<int32_t*>(step.logit_rows), static_cast<size_t>(step.num_logit_rows) * sizeof(int32_t),
                   kRoot);
}

void send_substeps(comm::Communicator& comm, std::span<const StepInput> steps) {
  const size_t ranks = static_cast<size_t>(comm.size());
  MOEX_CHECK(steps.size() == ranks, "one sub-step per rank: ", steps.size(), " for ", ranks, " ranks");
  std::vector<Header> h(ranks);
  for (size_t r = 0; r < ranks; ++r) {
    MOEX_CHECK(steps[r].logit_rows || steps[r].num_tokens == 0, "a sub-step names its logit rows");
    h[r] = header_of(steps[r]);
    h[r][3] = std::max<int64_t>(h[r][3], 0);
  }
  send_headers(comm, h.data());
  std::vector<std::vector<int64_t>> meta(ranks);
  std::vector<std::vector<int32_t>> tables(ranks);
  std::vector<comm::P2PRequest> sends;
  for (int r = 0; r < comm.size(); ++r) {
    if (r == kRoot) continue;
    const StepInput& s = steps[r];
    pack(s, meta[r], tables[r]);
    isend_array(comm, sends, s.tokens, static_cast<size_t>(s.num_tokens) * sizeof(int32_t), r);
    isend_array(comm, sends, meta[r].data(), meta[r].size() * sizeof(int64_t), r);
    isend_array(comm, sends, tables[r].data(), tables[r].size() * sizeof(int32_t), r);
    isend_array(comm, sends, s.logit_rows, static_cast<size_t>(h[r][3]) * sizeof(int32_t), r);
  }
  comm.wait_all(sends);
}

std::vector<comm::P2PRequest> receive_logits(comm::Communicator& comm, std::span<const StepInput> steps, int vocab,
                                             float* logits) {
  std::vector<comm::P2PRequest> receives;
  size_t row = 0;
  for (int r = 0; r < comm.size(); ++r) {
    const size_t rows = steps[r].logit_rows ? static_cast<size_t>(steps[r].num_logit_rows) : 0;
    if (r != kRoot && rows > 0)
      receives.push_back(comm.irecv(logits + row * vocab, rows * vocab * sizeof(float), r, kLogitsTag));
    row += rows;
  }
  return receives;
}

void run_step_worker(comm::Communicator& comm, DecoderModel& model, int64_t max_num_seqs) {
  const int64_t T = model.options().max_step_tokens;
  const bool dp = data_parallel(model);
  const int vocab = model.config().vocab_size;
  std::vector<int32_t> tokens, tables, rows;
  std::vector<int64_t> meta;
  std::vector<StepSeq> seqs;
  std::vector<float> logits(static_cast<size_t>(std::max<int64_t>(max_num_seqs, T)) * vocab);
  std::vector<comm::P2PRequest> requests;
  for (;;) {
    Header h;
    receive_header(comm, h);
    const auto command = static_cast<StepCommand>(h[0]);
    if (command == StepCommand::kStop) return;
    if (command == StepCommand::kIdle) continue;
    MOEX_CHECK(command == StepCommand::kStep && h[1] >= 0 && h[1] <= T && h[2] >= 0 && h[2] <= T && h[3] <= T &&
                   h[4] >= 0 && (!dp || (h[3] >= 0 && h[3] <= max_num_seqs)),
               "rank 0 sent a bad step header");
    tokens.resize(h[1]);
    meta.resize(3 * h[2]);
    tables.resize(h[4]);
    rows.resize(std::max<int64_t>(h[3], 0));
    if (dp) {  // this rank's own sub-step
      requests.clear();
      irecv_array(comm, requests, tokens.data(), tokens.size() * sizeof(int32_t));
      irecv_array(comm, requests, meta.data(), meta.size() * sizeof(int64_t));
      irecv_array(comm, requests, tables.data(), tables.size() * sizeof(int32_t));
      irecv_array(comm, requests, rows.data(), rows.size() * sizeof(int32_t));
      comm.wait_all(requests);
    } else {  // rank 0's step, the same on every rank
      comm.broadcast(tokens.data(), tokens.size() * sizeof(int32_t), kRoot);
      comm.broadcast(meta.data(), meta.size() * sizeof(int64_t), kRoot);
      comm.broadcast(tables.data(), tables.size() * sizeof(int32_t), kRoot);
      if (h[3] >= 0) comm.broadcast(rows.data(), rows.size() * sizeof(int32_t), kRoot);
    }
    seqs.resize(h[2]);
    int64_t offset = 0;
    for (int64_t s = 0; s < h[2]; ++s) {
      MOEX_CHECK(meta[3 * s + 2] >= 0 && offset + meta[3 * s + 2] <= h[4], "rank 0 sent a bad block table");
      seqs[s] = StepSeq{tables.data() + offset, meta[3 * s + 2], meta[3 * s], meta[3 * s + 1]};
      offset += meta[3 * s + 2];
    }
    StepInput step;
    step.tokens = tokens.data();
    step.num_tokens = h[1];
    step.seqs = seqs.data();
    step.num_seqs = h[2];
    if (h[3] >= 0) {
      step.logit_rows = rows.data();
      step.num_logit_rows = h[3];
    }
    model.forward(step, logits.data());  // under DP 0 rows still join the step's MoE collectives
    if (dp && h[3] > 0) {  // rank 0 samples this rank's rows
      requests.clear();
      requests.push_back(comm.isend(logits.data(), static_cast<size_t>(h[3]) * vocab * sizeof(float), kRoot, kLogitsTag));
      comm.wait_all(requests);
    }
    // Under TP rank 0 samples its own logits; this rank's are not used.
  }
}

}  // namespace moex::serve
