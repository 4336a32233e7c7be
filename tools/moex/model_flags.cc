#include "tools/moex/model_flags.h"

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "moex/base/error.h"
#include "moex/base/progress.h"
#include "moex/base/small_file.h"
#include "moex/base/system_memory.h"
#include "moex/base/threads.h"
#include "moex/comm/selector.h"
#include "moex/kernels/formats.h"
#include "moex/model/gguf.h"
#include "moex/model/panels_file.h"
#include "moex/model/safetensors.h"
#include "moex/model/weights.h"
#include "moex/runtime/run_memory.h"
#include "tools/lib/synthetic.h"
#include "tools/moex/model_check.h"

namespace moex::tools {

namespace {

// The packed formats' --weights spellings, from the format table (kernels/formats.h), and what each quantizes to.
std::vector<std::string> packed_format_names() {
  std::vector<std::string> names;
  for (const kernels::FormatTraits& t : kernels::all_formats()) names.emplace_back(t.name);
  for (const kernels::FormatTraits& t : kernels::all_formats())  // the short names ("fp8"), after the full ones
    if (!t.alias.empty()) names.emplace_back(t.alias);
  return names;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : " | ") + n;
  return out;
}

std::vector<std::string> with(std::vector<std::string> first, const std::vector<std::string>& rest) {
  first.insert(first.end(), rest.begin(), rest.end());
  return first;
}

}  // namespace

void ModelFlags::add_to(CLI::App* cmd) {
  cmd->add_option("--model", model_dir, "Hugging Face model folder (config.json + safetensors), or a llama.cpp .gguf file")->required();
  cmd->add_option("--max-seq-len", max_seq_len, "KV cache length per sequence")->capture_default_str();
  cmd->add_option("--step-tokens", max_step_tokens,
                  "The step's token budget: most tokens in one forward call (decode rows plus prompt chunks)")
      ->capture_default_str();
  cmd->add_option("--router-fusion", router_fusion, "Router: none | topk_softmax | full")->capture_default_str();
  cmd->add_option("--capacity-factor", capacity_factor, "Expert capacity factor; <= 0 is dropless")
      ->capture_default_str();
  cmd->add_flag("--check-weights", check_weights,
                "Read every weight once and refuse a checkpoint holding NaN or infinity, naming the tensor");
  weights_option =
      cmd->add_option("--weights", weights,
                      "Expert weights: auto (bf16 for a bf16/f16/f32 checkpoint, a quantized one as stored) | as-stored "
                      "(checkpoint dtype, f32 activations) | " + joined(packed_format_names()) +
                      " (docs/kernels.md, the format table; int4s per --group-size): quantized and packed once at load")
          ->capture_default_str()
          ->check(CLI::IsMember(with({"auto", "as-stored"}, packed_format_names())));
  dense_weights_option =
      cmd->add_option("--dense-weights", dense_weights,
                      "Attention projections and lm_head: auto (bf16 for a bf16/f16/f32 checkpoint unless --weights "
                      "as-stored; a quantized one as stored) | as-stored | " + joined(packed_format_names()) +
                      ", as --weights, or experts (the --weights format); the router and the norms stay as stored")
          ->capture_default_str()
          ->check(CLI::IsMember(with({"auto", "as-stored", "experts"}, packed_format_names())));
  cmd->add_option("--panels", panels,
                  "The packed panels to map instead of packing at load (moex pack --out PATH writes them; a stale or "
                  "other-path file is refused). Default: panels.moex beside the checkpoint, if there; none: pack at load");
  cmd->add_flag("--exact", exact,
                "The exact path of the PyTorch reference comparisons: the weights as stored with f32 activations and an "
                "f32 KV cache (= --weights as-stored --dense-weights as-stored --kv-cache-dtype f32)");
  add_quiet_flag(cmd);
  group_size_option = cmd->add_option("--group-size", group_size, "int4, int4-w4a8: weights per scale along K (32 | 64 | 128)")
                          ->capture_default_str()
                          ->check(CLI::IsMember({32, 64, 128}));
  kv_cache_dtype_option = cmd->add_option("--kv-cache-dtype", kv_cache_dtype,
                  "KV cache element type: bf16 (twice the positions of f32 in the same bytes) | f32 (exact; --exact "
                  "sets it)")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "bf16"}));
  cmd->add_flag("--eplb", eplb, "Expert-parallel load balancing (--moe-parallel ep): experts on physical slots, hot "
               "ones replicated (docs/moe.md)");
  cmd->add_option("--redundant-experts", redundant_experts, "--eplb: extra expert slots per EP rank")->capture_default_str();
  cmd->add_option("--eplb-window", eplb_window, "Steps over which tokens per expert are counted (0: off)")
      ->capture_default_str();
  cmd->add_option("--eplb-interval", eplb_interval, "--eplb: place the experts anew from the measured load every N "
                  "steps (0: never)")->capture_default_str();
  cmd->add_option("--expert-placement", expert_placement, "--eplb: the placement `moex plan-experts` wrote");
  cmd->add_flag("--batch-invariant", batch_invariant,
                "Each sequence's numbers independent of the rest of the batch: one kernel loop for every row count "
                "(needs dropless routing; docs/serve.md)");
  ThreadsFlags::add_to(cmd);
  ParallelFlags::add_to(cmd);
  CommFlags::add_to(cmd);
}

static ExpertWeightFormat weight_format_from_flag(const std::string& weights, int group_size) {
  ExpertWeightFormat f;
  f.packed = weights != "as-stored";
  f.group = group_size;
  if (!f.packed) return f;
  const std::optional<kernels::WeightFormat> format = kernels::weight_format_from_name(weights);
  MOEX_CHECK_INPUT(format.has_value(), "--weights ", weights, ": use as-stored | ", joined(packed_format_names()));
  f.format = *format;
  return f;
}

ModelFlags::WeightPath ModelFlags::weight_path(const ModelConfig& config) const {
  const auto given = [](const CLI::Option* o) { return o != nullptr && o->count() > 0; };
  std::string w = weights, dw = dense_weights;
  WeightPath path;
  path.kv_cache_dtype = kv_cache_dtype;
  if (exact) {
    MOEX_CHECK_INPUT(!given(weights_option) || weights == "as-stored", "--exact runs the experts as stored; it contradicts "
                     "--weights ", weights, " (give one of them)");
    MOEX_CHECK_INPUT(!given(dense_weights_option) || dense_weights == "as-stored", "--exact runs the dense weights as "
                     "stored; it contradicts --dense-weights ", dense_weights, " (give one of them)");
    MOEX_CHECK_INPUT(!given(kv_cache_dtype_option) || kv_cache_dtype == "f32", "--exact keeps an f32 KV cache; it "
                     "contradicts --kv-cache-dtype ", kv_cache_dtype, " (give one of them)");
    w = dw = "as-stored";
    path.kv_cache_dtype = "f32";
  }
  const bool quantized = config.quantization.quantized();
  std::string reason;  // why auto is not the fast path here
  if (w == "auto") {
    if (quantized) {
      w = "as-stored";  // (the description says so)
    } else if (plan.overlap) {
      w = "as-stored";
      reason = "--overlap needs the experts as stored";
    } else {
      w = "bf16";
    }
  }
  if (dw == "auto") dw = quantized || weights == "as-stored" || exact ? "as-stored" : "bf16";
  if (dw == "experts") dw = w;
  const auto int4 = [](const std::string& f) {  // the formats whose K group --group-size sets
    const std::optional<kernels::WeightFormat> format = kernels::weight_format_from_name(f);
    return format && kernels::group_is_user_set(*format);
  };
  MOEX_CHECK_INPUT(group_size_option == nullptr || group_size_option->count() == 0 || int4(w) || int4(dw),
                   "--group-size applies to --weights int4 or int4-w4a8 only (or --dense-weights int4; got --weights ", w,
                   ", --dense-weights ", dw, ")");
  path.experts = weight_format_from_flag(w, group_size);
  path.dense = weight_format_from_flag(dw, group_size);
  const std::string e = path.experts.name(), d = path.dense.name();
  if (w == "bf16" && dw == "bf16") {
    path.description = "bf16 (experts + dense, bf16 activations; --exact for the f32 path)";
  } else if (!path.experts.packed && !path.dense.packed) {
    path.description = quantized ? "as stored (quantized checkpoint: its own format)"
                                 : "as stored (f32 activations: the exact path)";
  } else {
    path.description = "experts " + e + ", dense " + d;
  }
  if (!reason.empty()) path.description += "; --weights auto: " + reason;
  return path;
}

ModelFlags::WeightPath ModelFlags::weight_path() const { return weight_path(load_checkpoint_config(model_dir)); }

namespace {

// With more than two ranks the order an all-reduce adds the ranks' values in can depend on where an element
// sits in the message (ring, Rabenseifner, NHR and mesh sum each chunk starting from a different rank), and
// the message is the whole step's rows: a sequence's numbers would depend on its neighbours. Recursive
// doubling and shm add every element in one order whatever the size (shm in rank order; recursive doubling
// pairs the same ranks for every element, and a + b == b + a exactly), so --batch-invariant pins `auto` to
// recursive doubling and refuses the others. Two ranks need nothing: one addition, commutative.
void pin_batch_invariant_allreduce() {
  comm::CommOptions options = comm::comm_options();
  switch (options.allreduce_algo) {
    case comm::AllreduceAlgo::kAuto:
      options.allreduce_algo = comm::AllreduceAlgo::kRecursiveDoubling;
      comm::set_comm_options(options);
      return;
    case comm::AllreduceAlgo::kRecursiveDoubling:
    case comm::AllreduceAlgo::kShm: return;
    default:
      MOEX_CHECK_INPUT(false, "--batch-invariant with more than 2 ranks needs an all-reduce that adds every element ",
                       "in one order: --allreduce-algo auto, rd or shm, not ", comm::algo_name(options.allreduce_algo));
  }
}

}  // namespace

std::shared_ptr<const eplb::ModelPlacement> ModelFlags::expert_placement_for(const ModelConfig& config,
                                                                            const ParallelPlan& plan,
                                                                            comm::Communicator& comm) const {
  MOEX_CHECK_INPUT(redundant_experts >= 0, "--redundant-experts ", redundant_experts, " must be >= 0");
  MOEX_CHECK_INPUT(eplb_window >= 0, "--eplb-window ", eplb_window, " must be >= 0");
  MOEX_CHECK_INPUT(eplb_interval >= 0, "--eplb-interval ", eplb_interval, " must be >= 0");
  MOEX_CHECK_INPUT(eplb || eplb_interval == 0, "--eplb-interval needs --eplb");
  MOEX_CHECK_INPUT(eplb || (redundant_experts == 0 && expert_placement.empty()), "--redundant-experts and ",
                   "--expert-placement need --eplb");
  if (!eplb) return nullptr;
  MOEX_CHECK_INPUT(plan.moe == MoEParallel::kEP && plan.tp == 1, "--eplb needs --moe-parallel ep");
  if (!expert_placement.empty()) {
    eplb::ModelPlacement p;
    try {
      p = eplb::parse_placement_json(read_small_file(expert_placement, size_t{64} << 20));
    } catch (const Error& e) {
      throw_input_error("--expert-placement " + expert_placement, e.what());
    }
    MOEX_CHECK_INPUT(p.slots_per_rank == config.num_local_experts / plan.ep + redundant_experts, "--expert-placement ",
                     expert_placement, ": ", p.slots_per_rank, " slots per rank, but --redundant-experts ",
                     redundant_experts, " gives ", config.num_local_experts / plan.ep + redundant_experts);
    return std::make_shared<const eplb::ModelPlacement>(std::move(p));
  }
  // No measured load yet: every expert equally loaded (the redundant slots replicate the lowest experts).
  auto p = std::make_shared<eplb::ModelPlacement>();
  p->experts = config.num_local_experts;
  p->ranks = plan.ep;
  p->slots_per_rank = config.num_local_experts / plan.ep + redundant_experts;
  const std::vector<double> uniform(config.num_local_experts, 1.0);
  for (int l = 0; l < config.num_hidden_layers; ++l)
    p->layers.push_back(config.moe_layer(l) ? eplb::place_experts(uniform, plan.ep, p->slots_per_rank, comm.topology().host_of_rank)
                                            : eplb::Placement{});
  return p;
}

std::unique_ptr<DecoderModel> ModelFlags::load(int batch) const {
  ThreadsFlags::apply();
  comm::Communicator& comm = world();
  // Every rank must load the same model (same content; the path may differ): a mismatch is one error. One rank
  // has nothing to compare with: it pays nothing.
  if (comm.size() > 1) check_same_model(comm, model_dir);
  const ModelConfig config = load_checkpoint_config(model_dir);
  MOEX_CHECK_INPUT(max_seq_len > 0, "--max-seq-len ", max_seq_len, " must be positive");
  MOEX_CHECK_INPUT(max_seq_len <= config.max_position_embeddings, "--max-seq-len ", max_seq_len,
                   " is more than the model's max_position_embeddings (", config.max_position_embeddings,
                   " in config.json): it was not trained for positions past that");
  MOEX_CHECK_INPUT(max_step_tokens > 0, "--step-tokens ", max_step_tokens, " must be positive");
  MOEX_CHECK_INPUT(batch > 0, "the number of sequences (", batch, ") must be positive");
  MOEX_CHECK_INPUT(std::isfinite(capacity_factor), "--capacity-factor ", capacity_factor,
                   " must be a finite number (<= 0: dropless)");
  if (check_weights) check_weights_finite(WeightStore(model_dir));
  ModelOptions options;
  options.max_seq_len = max_seq_len;
  options.max_batch = batch;
  options.max_step_tokens = max_step_tokens;
  options.router_fusion = router_fusion_from_name(router_fusion);
  options.capacity_factor = capacity_factor;
  options.plan = make_parallel_plan(plan,
                                    {config.num_attention_heads, config.num_key_value_heads, config.num_local_experts,
                                     config.intermediate_size},
                                    comm.size(), comm.rank(), &comm.topology());
  options.comm = &comm;
  const WeightPath path = weight_path(config);
  options.expert_weights = path.experts;
  options.kv_cache_dtype = parse_kv_cache_dtype(path.kv_cache_dtype);
  options.kv_cache_gb = kv_cache_gb;
  options.dense_weights = path.dense;
  options.panels = panels;
  options.batch_invariant = batch_invariant;
  options.expert_placement = expert_placement_for(config, options.plan, comm);
  // The window defaults to the interval: each rebalance sees the steps since the last one.
  options.eplb_window = eplb_window > 0 ? eplb_window : eplb_interval;
  options.eplb_interval = eplb_interval;
  if (batch_invariant && comm.size() > 2) pin_batch_invariant_allreduce();
  // A panels file of the kind this load packs (the load's own choice of kind) makes its whole matrices mappings,
  // not copies.
  const std::string kind = panels_kind(config.quantization.quantized(), path.experts, path.dense);
  const bool panels_mapped = !kind.empty() && panels_present(model_dir, panels, kind);
  check_run_memory(estimate_run_memory(config, options, num_threads(), panels_mapped), config, options,
                   available_memory());
  // On a terminal only: pipes and logs (and the tests that count stderr lines) see the path in each command's
  // report instead (generate's load line, serve's listening line, the bench headers).
  if (comm.rank() == 0 && progress_enabled()) std::fprintf(stderr, "moex: weights: %s\n", path.description.c_str());
  return std::make_unique<DecoderModel>(model_dir, options);
}

void SyntheticRunFlags::add_to(CLI::App* cmd, const std::string& steps_help) {
  cmd->add_option("--batch", batch, "Sequences decoded together")->capture_default_str();
  cmd->add_option("--prompt-len", prompt_len, "Synthetic prompt tokens per sequence")->capture_default_str();
  cmd->add_option("--steps", steps, steps_help)->capture_default_str();
}

void SyntheticRunFlags::check() const {
  MOEX_CHECK_INPUT(batch >= 1 && prompt_len >= 1 && steps >= 1, "--batch, --prompt-len and --steps must be >= 1");
  MOEX_CHECK_INPUT(prompt_len <= kMaxBenchTokens && steps <= kMaxBenchTokens, "--prompt-len and --steps must be <= ",
                   kMaxBenchTokens);
}

std::vector<std::vector<int>> SyntheticRunFlags::prompts(int vocab_size) const {
  return synthetic_prompts(batch, prompt_len, vocab_size);
}

}  // namespace moex::tools
