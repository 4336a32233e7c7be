// The start-up check that every rank of a job loads the same model: the same config, tensors, tokenizer
// and weight bytes, wherever each rank's copy lies (docs/DESIGN.md, "Multi-rank jobs").
#pragma once
#include <string>

#include "moex/comm/communicator.h"

namespace moex::tools {

// Collective over `comm`. Returns on every rank when every rank's `model_dir` holds the same model; else
// throws comm::JobError on every rank with one line on rank 0: each rank's error (a file it cannot read),
// or the first difference ("rank 1 differs from rank 0: tensor lm_head.weight content is XXH3 ..., rank 0
// has XXH3 ...").
void check_same_model(comm::Communicator& comm, const std::string& model_dir);

}  // namespace moex::tools
