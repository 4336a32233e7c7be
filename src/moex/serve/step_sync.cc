#include "moex/serve/step_sync.h"

#include <algorithm>
#include <chrono>
#include <thread>

#include "moex/base/error.h"

namespace moex::serve {
namespace {
constexpr int kRoot = 0;
// {command, num_tokens, num_seqs, num_logit_rows (-1: every row), table entries}
using Header = int64_t[5];
constexpr int kHeaderTag = 7301;  // the header's point-to-point messages (nothing else on this tag)

// The header goes point to point, not by broadcast: a waiting rank tests for it and sleeps in between
// (receive_header), where MPI_Bcast would spin a core for as long as the server is idle.
void send_header(comm::Communicator& comm, const Header& h) {
  std::vector<comm::P2PRequest> sends;
  for (int r = 0; r < comm.size(); ++r)
    if (r != kRoot) sends.push_back(comm.isend(h, sizeof(Header), r, kHeaderTag));
  comm.wait_all(sends);
}

// Tests for the header, spinning ~1 ms (a busy server's next step comes sooner), then sleeping 50 us
// growing to 1 ms between tests. Rank 0's idle heartbeat (100 ms) comes well within the comm timeout.
void receive_header(comm::Communicator& comm, Header& h) {
  comm::P2PRequest request = comm.irecv(h, sizeof(Header), kRoot, kHeaderTag);
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto limit = std::chrono::duration<double>(comm::comm_timeout_seconds());
  auto sleep = std::chrono::microseconds(50);
  for (uint64_t tests = 0; !comm.test_all({&request, 1}); ++tests) {
    const auto waited = Clock::now() - start;
    MOEX_CHECK(waited < limit, "moex serve: rank ", comm.rank(), " heard nothing from rank 0 for ",
               comm::comm_timeout_seconds(), " s (MOEX_COMM_TIMEOUT)");
    if (waited < std::chrono::milliseconds(1)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(sleep);
      sleep = std::min<std::chrono::microseconds>(sleep * 2, std::chrono::milliseconds(1));
    }
  }
}
}  // namespace

void send_command(comm::Communicator& comm, StepCommand command) {
  const Header h = {static_cast<int64_t>(command), 0, 0, 0, 0};
  send_header(comm, h);
}

void send_step(comm::Communicator& comm, const StepInput& step) {
  int64_t entries = 0;
  for (int64_t s = 0; s < step.num_seqs; ++s) entries += step.seqs[s].num_blocks;
  const Header h = {static_cast<int64_t>(StepCommand::kStep), step.num_tokens, step.num_seqs,
                    step.logit_rows ? step.num_logit_rows : -1, entries};
  send_header(comm, h);
  // Small steps: a few copies are cheaper than a message per table.
  std::vector<int64_t> meta(static_cast<size_t>(3 * step.num_seqs));
  std::vector<int32_t> tables;
  tables.reserve(static_cast<size_t>(entries));
  for (int64_t s = 0; s < step.num_seqs; ++s) {
    const StepSeq& q = step.seqs[s];
    meta[3 * s] = q.pos, meta[3 * s + 1] = q.len, meta[3 * s + 2] = q.num_blocks;
    tables.insert(tables.end(), q.block_table, q.block_table + q.num_blocks);
  }
  comm.broadcast(const_cast<int32_t*>(step.tokens), static_cast<size_t>(step.num_tokens) * sizeof(int32_t), kRoot);
  comm.broadcast(meta.data(), meta.size() * sizeof(int64_t), kRoot);
  comm.broadcast(tables.data(), tables.size() * sizeof(int32_t), kRoot);
  if (step.logit_rows)
    comm.broadcast(const_cast<int32_t*>(step.logit_rows), static_cast<size_t>(step.num_logit_rows) * sizeof(int32_t),
                   kRoot);
}

void run_step_worker(comm::Communicator& comm, MixtralModel& model, int64_t max_num_seqs) {
  const int64_t T = model.options().max_step_tokens;
  std::vector<int32_t> tokens, tables, rows;
  std::vector<int64_t> meta;
  std::vector<StepSeq> seqs;
  std::vector<float> logits(static_cast<size_t>(std::max<int64_t>(max_num_seqs, T)) * model.config().vocab_size);
  for (;;) {
    Header h;
    receive_header(comm, h);
    const auto command = static_cast<StepCommand>(h[0]);
    if (command == StepCommand::kStop) return;
    if (command == StepCommand::kIdle) continue;
    MOEX_CHECK(command == StepCommand::kStep && h[1] >= 0 && h[1] <= T && h[2] >= 0 && h[2] <= T && h[3] <= T &&
                   h[4] >= 0,
               "rank 0 sent a bad step header");
    tokens.resize(h[1]);
    meta.resize(3 * h[2]);
    tables.resize(h[4]);
    comm.broadcast(tokens.data(), tokens.size() * sizeof(int32_t), kRoot);
    comm.broadcast(meta.data(), meta.size() * sizeof(int64_t), kRoot);
    comm.broadcast(tables.data(), tables.size() * sizeof(int32_t), kRoot);
    if (h[3] >= 0) {
      rows.resize(h[3]);
      comm.broadcast(rows.data(), rows.size() * sizeof(int32_t), kRoot);
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
    model.forward(step, logits.data());  // rank 0 samples; this rank's logits are not used
  }
}

}  // namespace moex::serve
