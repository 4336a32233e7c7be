// Flags every command that loads a model shares (--model, --max-seq-len, --router-fusion, ...).
#pragma once
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "moex/model/mixtral.h"

namespace moex::tools {

struct ModelFlags {
  std::string model_dir;
  int max_seq_len = 2048;
  int max_step_tokens = 512;
  std::string router_fusion = "full";
  float capacity_factor = 0.0f;
  int threads = 0;

  void add_to(CLI::App* cmd);
  // Applies --threads and builds the model for `batch` sequences.
  std::unique_ptr<MixtralModel> load(int batch) const;
};

}  // namespace moex::tools
