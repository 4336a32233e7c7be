// `moex bench quality`: what a weight format costs in accuracy, as llama.cpp's `perplexity --kl-divergence`
// measures it: over a fixed set of prompts, at every position, the KL divergence KL(P || Q) of the quantized
// model's next-token distribution Q from the as-stored (bf16) model's P, and the share of positions whose
// top-1 token agrees. The reference is the same checkpoint as stored, run in the same process.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/runtime/generation.h"
#include "tools/lib/synthetic.h"
#include "tools/moex/bench.h"
#include "tools/moex/model_flags.h"

namespace moex::tools {
namespace {

struct QualityFlags {
  ModelFlags model;
  std::string quantized_dir;  // a checkpoint written by `moex quantize`: compared instead of --weights
  int prompts = 16, prompt_len = 128;
  std::vector<int> ids;  // one explicit prompt instead of the synthetic ones
  bool json = false;
};

// log-softmax of one row of logits, in double.
void log_softmax(const float* logits, int64_t n, std::vector<double>& out) {
  out.resize(n);
  const double top = *std::max_element(logits, logits + n);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(double(logits[i]) - top);
  const double log_sum = std::log(sum) + top;
  for (int64_t i = 0; i < n; ++i) out[i] = double(logits[i]) - log_sum;
}

// Logits [prompts * prompt_len, V] of every position: each prompt is one prefill of a fresh sequence.
std::vector<float> all_logits(DecoderModel& model, const std::vector<std::vector<int>>& prompts) {
  const int64_t V = model.config().vocab_size;
  std::vector<float> out, last(V);
  KvBlockManager kv = make_block_manager(model);
  for (const auto& p : prompts) {
    const size_t at = out.size();
    out.resize(at + p.size() * V);
    prefill(model, kv, 0, p, last.data(), out.data() + at);
    kv.free(0);
  }
  return out;
}

void run_quality(QualityFlags& f) {
  MOEX_CHECK_INPUT(f.prompts >= 1 && f.prompt_len >= 2, "--prompts must be >= 1 and --prompt-len >= 2");
  if (!f.ids.empty()) {  // one given prompt
    f.prompts = 1;
    f.prompt_len = static_cast<int>(f.ids.size());
  }
  MOEX_CHECK_INPUT(f.prompt_len <= f.model.max_step_tokens, "--prompt-len ", f.prompt_len,
                   " must be at most --step-tokens (", f.model.max_step_tokens, "): each prompt is one prefill");
  MOEX_CHECK_INPUT(f.prompt_len <= f.model.max_seq_len, "--prompt-len ", f.prompt_len, " must be at most --max-seq-len");
  const bool compare_checkpoint = !f.quantized_dir.empty();
  // What runs against the as-stored reference: --weights / --dense-weights (auto: bf16 on a bf16/f16/f32
  // checkpoint), or the --quantized checkpoint as stored.
  const ModelFlags::WeightPath path = f.model.weight_path();  // a bad flag combination is refused before the long runs
  MOEX_CHECK_INPUT(compare_checkpoint || path.experts.packed || path.dense.packed,
                   "bench quality compares a format with the as-stored model: give --weights, --dense-weights or "
                   "--quantized DIR (not --exact: that is the reference itself)");
  // The reference: the checkpoint as stored.
  ModelFlags base = f.model;
  base.weights = base.dense_weights = "as-stored";
  base.exact = false;
  base.group_size_option = base.weights_option = base.dense_weights_option = nullptr;
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::vector<int>> prompts;
  std::vector<float> reference;
  std::string reference_name;
  {
    const std::unique_ptr<DecoderModel> model = base.load(1);
    MOEX_CHECK_INPUT(!model->weights().quantized_checkpoint, "--model ", base.model_dir,
                     " is a quantized checkpoint: give the bf16 model as --model and the quantized one as --quantized");
    reference_name = model->config().torch_dtype;
    prompts = synthetic_prompts(f.prompts, f.prompt_len, model->config().vocab_size);
    if (!f.ids.empty()) {
      for (int id : f.ids)
        MOEX_CHECK_INPUT(id >= 0 && id < model->config().vocab_size, "--ids: token id ", id, " is outside the vocabulary");
      prompts = {f.ids};
    }
    reference = all_logits(*model, prompts);
  }
  ModelFlags other = f.model;
  std::string name = "weights " + path.experts.name() + ", dense " + path.dense.name();
  if (compare_checkpoint) {
    other.model_dir = f.quantized_dir;
    name = "checkpoint " + f.quantized_dir;
  }
  std::vector<float> quantized;
  int64_t V = 0;
  {
    const std::unique_ptr<DecoderModel> model = other.load(1);
    V = model->config().vocab_size;
    const ModelConfig& a = model->config();
    MOEX_CHECK_INPUT(static_cast<int64_t>(reference.size()) == f.prompts * int64_t{f.prompt_len} * V, "--quantized ",
                     f.quantized_dir, " has another vocabulary than --model");
    MOEX_CHECK_INPUT(!compare_checkpoint || model->weights().quantized_checkpoint, "--quantized ", f.quantized_dir,
                     " has no quantization_config (it is not a quantized checkpoint)");
    (void)a;
    quantized = all_logits(*model, prompts);
  }
  const int64_t positions = f.prompts * int64_t{f.prompt_len};
  std::vector<double> kl(positions), lp, lq;
  // A top-1 flip needs the format's error to exceed the stored model's gap between its two best logits, so
  // the gaps at the flips, beside the gaps everywhere, say whether a flip is a near-tie or a real error
  // (a model with random weights has far flatter distributions than a trained one: many near-ties).
  std::vector<double> gaps(positions), flip_gaps, top1_prob(positions);
  int64_t agree = 0;
  for (int64_t i = 0; i < positions; ++i) {
    const float* p = reference.data() + i * V;
    const float* q = quantized.data() + i * V;
    log_softmax(p, V, lp);
    log_softmax(q, V, lq);
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(lp[v]) * (lp[v] - lq[v]);
    kl[i] = std::max(sum, 0.0);
    const int64_t best = std::max_element(p, p + V) - p;
    float second = -INFINITY;
    for (int64_t v = 0; v < V; ++v)
      if (v != best) second = std::max(second, p[v]);
    gaps[i] = double(p[best]) - second;
    top1_prob[i] = std::exp(lp[best]);
    const bool same = best == std::max_element(q, q + V) - q;
    agree += same;
    if (!same) flip_gaps.push_back(gaps[i]);
  }
  const auto median = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  const double gap_median = median(gaps), flip_gap_median = median(flip_gaps), prob_median = median(top1_prob);
  const double flip_gap_max = flip_gaps.empty() ? 0.0 : *std::max_element(flip_gaps.begin(), flip_gaps.end());
  // The share of positions whose gap is at least the largest gap at which a flip happened: there, top-1 held.
  const int64_t above = std::count_if(gaps.begin(), gaps.end(), [&](double g) { return g > flip_gap_max; });
  std::vector<double> sorted = kl;
  std::sort(sorted.begin(), sorted.end());
  const auto quantile = [&](double x) { return sorted[std::min<int64_t>(positions - 1, int64_t(x * (positions - 1) + 0.5))]; };
  const double mean = std::accumulate(kl.begin(), kl.end(), 0.0) / positions;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double top1 = 100.0 * agree / positions;
  if (f.json) {
    std::printf("%s\n", nlohmann::json{{"model", f.model.model_dir}, {"reference", reference_name}, {"compared", name},
                                       {"prompts", f.prompts}, {"prompt_len", f.prompt_len}, {"positions", positions},
                                       {"kl_mean", mean}, {"kl_median", quantile(0.5)}, {"kl_p99", quantile(0.99)},
                                       {"kl_max", sorted.back()}, {"top1_agree_percent", top1},
                                       {"top1_prob_median", prob_median}, {"top2_gap_median", gap_median},
                                       {"flip_top2_gap_median", flip_gap_median}, {"flip_top2_gap_max", flip_gap_max},
                                       {"positions_above_flip_gap_max", above}, {"seconds", seconds}}
                            .dump()
                            .c_str());
    return;
  }
  std::printf("bench quality: %s against the model as stored (%s), %d synthetic prompts x %d positions\n",
              name.c_str(), reference_name.c_str(), f.prompts, f.prompt_len);
  std::printf("  KL(P_stored || P_quantized) per position: mean %.3g, median %.3g, p99 %.3g, max %.3g\n", mean,
              quantile(0.5), quantile(0.99), sorted.back());
  std::printf("  top-1 agrees on %.2f%% of %lld positions   (%.1f s, %d threads)\n", top1,
              static_cast<long long>(positions), seconds, num_threads());
  std::printf("  stored model: median top-1 probability %.3g, median gap between its two best logits %.3g\n",
              prob_median, gap_median);
  if (!flip_gaps.empty())
    std::printf("  at the %zu flips that gap was: median %.3g, max %.3g (%.1f%% of positions have a larger gap)\n",
                flip_gaps.size(), flip_gap_median, flip_gap_max, 100.0 * above / positions);
}

void setup_quality(CLI::App& bench) {
  auto f = std::make_shared<QualityFlags>();
  auto* cmd = bench.add_subcommand("quality", "KL divergence and top-1 agreement of a weight format against the as-stored model");
  f->model.add_to(cmd);
  cmd->add_option("--quantized", f->quantized_dir,
                  "Compare a quantized checkpoint (moex quantize) of --model instead of quantizing at load");
  cmd->add_option("--prompts", f->prompts, "Synthetic prompts (fixed: the same ids every run)")->capture_default_str();
  cmd->add_option("--prompt-len", f->prompt_len, "Positions per prompt")->capture_default_str();
  add_list_flag(cmd, "--ids", f->ids, "One prompt of these token ids instead of the synthetic prompts");
  cmd->add_flag("--json", f->json, "One JSON object");
  cmd->callback([f] { run_quality(*f); });
}
MOEX_REGISTER_BENCH(setup_quality);

}  // namespace
}  // namespace moex::tools
