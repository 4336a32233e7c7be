// Multi-rank serving: rank 0 owns HTTP and the scheduler(s) and sends each step's StepInput to the other
// ranks. One message pattern for both attention plans: a header point to point to every rank (its command
// and the sizes of its arrays), then the arrays.
//  - attention TP: every rank runs the same step (same tokens, same block ids in its own pool of the same
//    shape), so the arrays go by broadcast; rank 0 samples its own logits.
//  - attention DP: rank r runs its own sub-step (its sequences through its own pool; possibly 0 rows, still
//    joining the MoE collectives), so each rank's header and arrays go point to point, and after the forward
//    each rank sends its logit rows back to rank 0, which samples every rank's rows.
// A waiting rank sleeps between tests for the header (no core spinning while the server idles). Idle, rank 0
// sends a heartbeat every 100 ms, so a rank that hears nothing for the comm timeout knows rank 0 is gone; at
// shutdown it sends stop.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "moex/comm/communicator.h"
#include "moex/model/decoder.h"

namespace moex::serve {

enum class StepCommand : int64_t { kStep = 0, kIdle = 1, kStop = 2 };

// Rank 0, attention TP: the header (point to point), then the step's arrays (broadcasts).
void send_step(comm::Communicator& comm, const StepInput& step);
// Rank 0, attention DP: steps[r] is rank r's sub-step (steps.size() == comm.size(); steps[0] is rank 0's own,
// not sent). Each step needs logit_rows (0 rows: no logits).
void send_substeps(comm::Communicator& comm, std::span<const StepInput> steps);
// Rank 0, attention DP, after send_substeps: posts the receives of every other rank's logit rows into
// `logits` ([sum of num_logit_rows, vocab], rank order: rank 0's rows first). wait_all() them after rank 0's
// own forward (a rank that stops answering fails the wait after the comm timeout).
std::vector<comm::P2PRequest> receive_logits(comm::Communicator& comm, std::span<const StepInput> steps, int vocab,
                                             float* logits);
void send_command(comm::Communicator& comm, StepCommand command);  // kIdle or kStop

// The other ranks: runs every step rank 0 sends through `model` until kStop (under attention DP its own
// sub-steps, sending their logit rows back).
void run_step_worker(comm::Communicator& comm, DecoderModel& model, int64_t max_num_seqs);

}  // namespace moex::serve
