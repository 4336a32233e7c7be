// Flags every command that loads a model shares (--model, --max-seq-len, --router-fusion, ... and the
// threads, parallel and comm groups of flags.h), and the model they build on this rank.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "moex/comm/communicator.h"
#include "moex/model/decoder.h"
#include "tools/moex/flags.h"

namespace moex::tools {

struct ModelFlags : ThreadsFlags, ParallelFlags, CommFlags {
  std::string model_dir;
  int max_seq_len = 2048;
  int max_step_tokens = 512;
  std::string router_fusion = "full";
  float capacity_factor = 0.0f;
  bool check_weights = false;  // scan every tensor for NaN / infinity before loading
  // --weights auto / --dense-weights auto (the defaults) are the fast path: a bf16/f16/f32 checkpoint's experts,
  // attention projections and lm_head packed to bf16 at load and run with bf16 activations; a quantized
  // checkpoint runs as stored (its own format); the KV cache is bf16. Every command starts from these defaults
  // (none sets its own), so they all run, measure and serve one path. --exact is the f32-activation path (as
  // stored, f32 KV cache) the PyTorch reference comparisons use.
  std::string weights = "auto";       // the experts: auto | as-stored | bf16 | int8 | ... | fp8 (packed at load)
  int group_size = 128;               // int4: weights per scale along K
  CLI::Option* group_size_option = nullptr;
  std::string kv_cache_dtype = "bf16";  // the paged KV pool: bf16 (twice the positions of f32) | f32 (exact)
  double kv_cache_gb = 0.0;            // > 0: the pool's size (`serve --kv-cache-gb`); else batch x --max-seq-len
  std::string dense_weights = "auto";  // attention projections and lm_head: auto | experts | as --weights (packed at load)
  // --panels PATH: the panels.moex to map (moex pack --out PATH wrote it); "none": pack at load; empty: the one
  // beside the checkpoint, if any (model/panels_file.h).
  std::string panels;
  bool exact = false;            // --exact: --weights as-stored --dense-weights as-stored --kv-cache-dtype f32
  bool batch_invariant = false;  // --batch-invariant: ModelOptions::batch_invariant
  // EPLB (docs/moe.md, "Expert load balancing"): --eplb gives each EP rank --redundant-experts extra slots, filled
  // by --expert-placement FILE (moex plan-experts) or, without one, from a uniform load; --eplb-window N keeps the
  // tokens per expert of the last N steps (DecoderModel::expert_load()).
  bool eplb = false;
  int redundant_experts = 0;
  int eplb_window = 0;
  int eplb_interval = 0;  // --eplb-interval N: rebalance every N steps (DecoderModel::between_steps)
  std::string expert_placement;
  // Set by add_to; null when the flags were not added to a command (a copy made in code). They tell a value the
  // user gave from a default (--exact refuses only what contradicts it).
  CLI::Option* weights_option = nullptr;
  CLI::Option* dense_weights_option = nullptr;
  CLI::Option* kv_cache_dtype_option = nullptr;

  // What runs, with --weights / --dense-weights auto resolved for this checkpoint: the two formats and one line
  // saying which path runs and why (e.g. "bf16 (experts + dense, bf16 activations; --exact for the f32 path)").
  struct WeightPath {
    ExpertWeightFormat experts, dense;
    std::string kv_cache_dtype;
    std::string description;
  };
  // One error line for a bad combination (--exact against an explicit contradicting value, --group-size without
  // int4).
  WeightPath weight_path(const ModelConfig& config) const;
  // weight_path for the checkpoint --model names (reads its config.json).
  WeightPath weight_path() const;

  // Adds these flags and the three groups'.
  void add_to(CLI::App* cmd);
  // Applies --threads, builds the plan for this rank and loads its share of the model for `batch`
  // sequence slots.
  std::unique_ptr<DecoderModel> load(int batch) const;
  // The placement --eplb asks for (null without it): --expert-placement's file, checked against the model and plan,
  // else one from a uniform load. One error line for a bad file or combination.
  std::shared_ptr<const eplb::ModelPlacement> expert_placement_for(const ModelConfig& config, const ParallelPlan& plan,
                                                                   comm::Communicator& comm) const;
};

// Bound on the synthetic prompt lengths and step counts of `bench decode` and `profile`, so that the sums
// they size --max-seq-len with stay ints; the model's max_position_embeddings then decides.
inline constexpr int kMaxBenchTokens = 1 << 24;

// The synthetic workload of `bench decode` and `profile`: --batch sequences of --prompt-len synthetic_prompts
// ids, then --steps decode steps.
struct SyntheticRunFlags {
  int batch = 1;
  int prompt_len;
  int steps = 32;

  explicit SyntheticRunFlags(int default_prompt_len) : prompt_len(default_prompt_len) {}
  void add_to(CLI::App* cmd, const std::string& steps_help);
  // Each at least 1 and at most kMaxBenchTokens.
  void check() const;
  std::vector<std::vector<int>> prompts(int vocab_size) const;
};

// Sequences are dealt to ranks round-robin under attention DP; everything else sees every sequence.
inline bool rank_serves_sequence(const ParallelPlan& plan, int sequence) {
  return plan.attn == AttnParallel::kTP || plan.single() || sequence % plan.world == plan.rank;
}

}  // namespace moex::tools
