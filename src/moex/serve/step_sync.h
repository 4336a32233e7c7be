// Multi-rank serving: rank 0 owns HTTP and the scheduler and sends each step's StepInput to the other ranks,
// which run the same forward (under attention TP every rank needs the same plan: same tokens, same block
// ids in its own pool of the same shape). Each step's header goes point to point and a waiting rank
// sleeps between tests for it (no core spinning while the server idles); the step's arrays follow by
// broadcast. Idle, rank 0 sends a heartbeat every 100 ms, so a rank that hears nothing for the comm
// timeout knows rank 0 is gone; at shutdown it sends stop.
#pragma once
#include <cstdint>
#include <vector>

#include "moex/comm/communicator.h"
#include "moex/model/mixtral.h"

namespace moex::serve {

enum class StepCommand : int64_t { kStep = 0, kIdle = 1, kStop = 2 };

// Rank 0: the header (point to point), then the step's arrays (broadcasts).
void send_step(comm::Communicator& comm, const StepInput& step);
void send_command(comm::Communicator& comm, StepCommand command);  // kIdle or kStop

// The other ranks: runs every step rank 0 sends through `model` until kStop.
void run_step_worker(comm::Communicator& comm, MixtralModel& model, int64_t max_num_seqs);

}  // namespace moex::serve
