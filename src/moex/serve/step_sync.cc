#include "moex/serve/step_sync.h"

#include <algorithm>

#include "moex/base/error.h"

namespace moex::serve {
namespace {
constexpr int kRoot = 0;
// {command, num_tokens, num_seqs, num_logit_rows (-1: every row), table entries}
using Header = int64_t[5];
}  // namespace

void send_command(comm::Communicator& comm, StepCommand command) {
  Header h = {static_cast<int64_t>(command), 0, 0, 0, 0};
  comm.broadcast(h, sizeof(h), kRoot);
}

void send_step(comm::Communicator& comm, const StepInput& step) {
  int64_t entries = 0;
  for (int64_t s = 0; s < step.num_seqs; ++s) entries += step.seqs[s].num_blocks;
  Header h = {static_cast<int64_t>(StepCommand::kStep), step.num_tokens, step.num_seqs,
              step.logit_rows ? step.num_logit_rows : -1, entries};
  comm.broadcast(h, sizeof(h), kRoot);
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
    comm.broadcast(h, sizeof(h), kRoot);
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
