// Failing together: what a multi-rank job does when one rank (or several) hits an error, and the start-up
// check that every rank runs the same thing. Why: a rank that just returns from main leaves its peers
// waiting forever in a collective (and itself in MPI_Win_free / MPI_Finalize), and ranks that disagree on
// flags or model run mismatched collectives and give silently wrong answers.
#pragma once
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moex/base/error.h"
#include "moex/comm/communicator.h"

namespace moex::comm {

// Thrown on EVERY rank when a collective check (check_same_on_all_ranks) found an error or a difference:
// all ranks know it, so the job ends in order (no abort). Only rank 0 carries lines to print.
class JobError : public Error {
 public:
  JobError(ErrorKind kind, const std::string& message, std::vector<std::string> report_lines)
      : Error(kind, message), report_lines_(std::move(report_lines)) {}
  // One-line messages this rank prints (empty on every rank but rank 0).
  const std::vector<std::string>& report_lines() const { return report_lines_; }

 private:
  std::vector<std::string> report_lines_;
};

// What must be equal on every rank, in order: (name, value), e.g. ("--seed", "1").
using Description = std::vector<std::pair<std::string, std::string>>;

// Collective over `comm`. Every rank runs describe(); an error it throws is shared instead of thrown
// locally. Then every rank returns when all descriptions equal rank 0's, else throws JobError: the errors
// (each distinct message once, naming its ranks: "rank 1: ..."), or the first difference of the lowest rank
// that differs ("rank 1 differs from rank 0: --seed is 2, rank 0 has 1"; exit 2).
void check_same_on_all_ranks(Communicator& comm, const std::function<Description()>& describe);

// The line check_same_on_all_ranks prints for two descriptions that differ: the first name whose value
// differs or is missing on one side ("rank 1 differs from rank 0: --seed is 2, rank 0 has 1"), else where
// the order of the same items differs, else their counts; "" when equal.
std::string first_difference(int rank, const Description& mine, const Description& reference);

// True in a job of several MPI ranks (after MPI init, before finalize): an error must go through abort_job.
bool in_multi_rank_job();

// Ends the whole job for an error on this rank that its peers do not know about (they may be anywhere,
// e.g. waiting in a collective). Tells the other ranks, waits a short grace period for errors they raise
// at about the same time, and the lowest failing rank prints each distinct message once as
// `prefix + "rank N: " + message` (one line each) and calls MPI_Abort(exit_code); mpirun then kills every
// rank and exits with that code. Call only when in_multi_rank_job().
[[noreturn]] void abort_job(int exit_code, const std::string& message, std::string_view prefix);

}  // namespace moex::comm
