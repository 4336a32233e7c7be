// `moex bench batch-variance`: how often a sequence's greedy output changes because of its neighbours in the
// batch. Each prompt runs alone (prefill, then greedy decode steps, one sequence) and then all of them are
// served together by the serving engine (serve/engine.h: continuous batching, prefill chunks beside decode
// rows, as `moex serve` runs them). Per prompt it reports whether the served tokens equal the ones alone,
// and at the first difference the top-2 logit gap of the run alone (a flip needs the two best tokens within
// the batch's rounding of each other) and the rank the served token had there; before it, how many steps gave
// the same token a logprob that differs in any bit (the numbers moved without flipping the choice). With --batch-invariant every
// row must agree. The reference (alone) is measured in the same process on the same loaded model.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/runtime/generation.h"
#include "moex/runtime/sampler.h"
#include "moex/serve/engine.h"
#include "tools/lib/synthetic.h"
#include "tools/moex/bench.h"
#include "tools/moex/model_flags.h"

namespace moex::tools {
namespace {

struct VarianceFlags {
  ModelFlags model;
  int prompts = 64;
  int min_len = 4, max_len = 96;  // prompt lengths spread over [min_len, max_len]
  int tokens = 32;                // greedy tokens per prompt
  int max_num_seqs = 64;  // the engine's (serve's default); its step budget is --step-tokens
  bool json = false;
};

// Both runs sample through a Sampler with logprobs (greedy), so a token's logprob is computed the same way on
// both sides: equal logits give the same float, and any difference in the logits shows in it.
SamplerOptions greedy_with_logprobs() {
  SamplerOptions o;
  o.logprobs = true;
  o.top_logprobs = kMaxTopLogprobs;
  return o;
}

// The prompt alone on the engine (one sequence per step), under every rank as the served run.
std::vector<SampledToken> run_alone(DecoderModel& model, const std::vector<int>& prompt, int n) {
  GenerationOptions options;
  options.max_new_tokens = n;
  options.stop_at_eos = false;
  options.sampler = greedy_with_logprobs();
  options.max_num_seqs = 1;
  GenerationResult r = generate(model, {prompt}, options);
  // Every rank gets the tokens and their logprobs (generate() broadcasts them).
  MOEX_CHECK(r.logprobs.size() == 1 && r.logprobs[0].size() == r.new_tokens[0].size(), "generate() gave this rank ",
             r.logprobs.empty() ? 0 : r.logprobs[0].size(), " logprobs for ", r.new_tokens[0].size(), " tokens");
  for (size_t i = 0; i < r.new_tokens[0].size(); ++i)
    MOEX_CHECK(r.logprobs[0][i].token == r.new_tokens[0][i], "generate(): a logprob names another token than its step's");
  return std::move(r.logprobs[0]);
}

void run_variance(const VarianceFlags& f) {
  MOEX_CHECK_INPUT(f.prompts >= 1 && f.tokens >= 1, "--prompts and -n must be at least 1");
  MOEX_CHECK_INPUT(f.min_len >= 1 && f.min_len <= f.max_len, "--min-len ", f.min_len, " must be in [1, --max-len ",
                   f.max_len, "]");
  MOEX_CHECK_INPUT(f.max_len + f.tokens <= f.model.max_seq_len, "--max-len + -n (", f.max_len + f.tokens,
                   ") must be at most --max-seq-len (", f.model.max_seq_len, ")");
  MOEX_CHECK_INPUT(f.max_num_seqs >= 1 && f.model.max_step_tokens >= f.max_num_seqs,
                   "--step-tokens must be at least --max-num-seqs");
  const auto start = std::chrono::steady_clock::now();
  const std::unique_ptr<DecoderModel> model = f.model.load(f.max_num_seqs);
  const int V = model->config().vocab_size;
  // Prompt i: the first len_i ids of synthetic prompt i, lengths spread evenly over [min_len, max_len].
  const std::vector<std::vector<int>> ids = synthetic_prompts(f.prompts, f.max_len, V);
  std::vector<std::vector<int>> prompts(f.prompts);
  for (int i = 0; i < f.prompts; ++i) {
    const int len = f.min_len + static_cast<int>((static_cast<int64_t>(i) * 37 % f.prompts) * (f.max_len - f.min_len) /
                                                 std::max(1, f.prompts - 1));
    prompts[i].assign(ids[i].begin(), ids[i].begin() + len);
  }
  std::vector<std::vector<SampledToken>> alone;
  for (const auto& p : prompts) alone.push_back(run_alone(*model, p, f.tokens));
  std::vector<std::vector<int32_t>> served(f.prompts);
  std::vector<std::vector<float>> served_logprob(f.prompts);
  // Under mpirun, as in `moex serve`: rank 0's engine schedules and every other rank runs the steps it sends.
  // (Each rank with an engine of its own scheduled on its own: requests submitted while a loop already ran
  // let the ranks form different first steps, and their collectives met with different sizes:
  // MPI_ERR_TRUNCATE, then a crash, in about one run in five on a loaded machine.)
  const ParallelPlan& plan = model->options().plan;
  if (plan.rank != 0) {
    run_step_worker(*model->options().comm, *model, f.model.max_step_tokens);
    return;  // rank 0 prints the report
  }
  {
    EngineOptions eo;
    if (!plan.single()) eo.comm = model->options().comm;
    eo.max_num_seqs = f.max_num_seqs;
    eo.max_step_tokens = f.model.max_step_tokens;
    eo.max_waiting = f.prompts;
    eo.max_model_len = f.model.max_seq_len;
    eo.prefix_caching = false;  // every prompt computed, as alone
    serve::Engine engine(*model, eo);
    std::vector<std::shared_ptr<serve::RequestStream>> streams;
    for (const auto& p : prompts) {
      GenerationRequest r;
      r.prompt.assign(p.begin(), p.end());
      r.max_tokens = f.tokens;
      r.ignore_eos = true;
      r.sampler = greedy_with_logprobs();
      streams.push_back(engine.submit(r));
      MOEX_CHECK(streams.back() != nullptr, "the engine refused a request");
    }
    for (int i = 0; i < f.prompts; ++i) {
      for (;;) {
        serve::RequestStream::Read r = streams[i]->wait(std::chrono::milliseconds(100));
        served[i].insert(served[i].end(), r.tokens.begin(), r.tokens.end());
        for (const SampledToken& t : r.logprobs) served_logprob[i].push_back(t.logprob);
        MOEX_CHECK(r.error.empty(), "request ", i, " failed: ", r.error);
        if (r.finished) break;
      }
    }
  }
  struct Diff {
    int prompt, length, at;
    int32_t alone_token, served_token;
    float gap;  // top-1 minus top-2 logprob alone (= the logit gap)
    int rank;   // of the served token among the top 20 alone (2: the runner-up), 0: below them
  };
  std::vector<Diff> diffs;
  // Over the steps before each prompt's first difference (the same token on both sides): how many gave that
  // token a logprob that differs in any bit, and the largest difference.
  int64_t same_steps = 0, numeric_steps = 0;
  double max_logprob_diff = 0;
  for (int i = 0; i < f.prompts; ++i) {
    const auto& a = alone[i];
    MOEX_CHECK(served[i].size() == static_cast<size_t>(f.tokens) && served_logprob[i].size() == served[i].size(),
               "request ", i, " returned ", served[i].size(), " tokens");
    int at = 0;
    for (; at < f.tokens && served[i][at] == a[at].token; ++at) {
      ++same_steps;
      numeric_steps += served_logprob[i][at] != a[at].logprob;
      max_logprob_diff = std::max(max_logprob_diff, std::fabs(double(served_logprob[i][at]) - a[at].logprob));
    }
    if (at == f.tokens) continue;
    const int32_t t = served[i][at];
    int rank = 0;
    for (size_t j = 0; j < a[at].top.size(); ++j)
      if (a[at].top[j].token == t) rank = static_cast<int>(j) + 1;
    diffs.push_back({i, static_cast<int>(prompts[i].size()), at, a[at].token, t,
                     a[at].top[0].logprob - a[at].top[1].logprob, rank});
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // For scale: the median top-2 gap over every step alone.
  std::vector<float> all_gaps;
  for (const auto& a : alone)
    for (const SampledToken& t : a) all_gaps.push_back(t.top[0].logprob - t.top[1].logprob);
  std::sort(all_gaps.begin(), all_gaps.end());
  const float median_gap = all_gaps[all_gaps.size() / 2];
  const std::string weights = model->options().expert_weights.name() + ", dense " + model->options().dense_weights.name();
  if (f.json) {
    nlohmann::json rows = nlohmann::json::array();
    for (const Diff& d : diffs)
      rows.push_back({{"prompt", d.prompt}, {"prompt_len", d.length}, {"first_difference", d.at},
                      {"alone_token", d.alone_token}, {"served_token", d.served_token}, {"top2_gap_alone", d.gap},
                      {"served_token_rank_alone", d.rank}});
    std::printf("%s\n", nlohmann::json{{"model", f.model.model_dir}, {"weights", weights},
                                       {"batch_invariant", f.model.batch_invariant}, {"prompts", f.prompts},
                                       {"tokens", f.tokens}, {"max_num_seqs", f.max_num_seqs},
                                       {"max_step_tokens", f.model.max_step_tokens}, {"differ", diffs.size()},
                                       {"median_top2_gap_alone", median_gap}, {"differences", rows},
                                       {"same_token_steps", same_steps}, {"logprob_differs_steps", numeric_steps},
                                       {"max_logprob_diff", max_logprob_diff},
                                       {"seconds", seconds}}
                            .dump()
                            .c_str());
    return;
  }
  std::printf("bench batch-variance: %d prompts of %d..%d tokens, %d greedy tokens each; alone vs served together "
              "(max-num-seqs %d, step-tokens %d); weights %s%s\n",
              f.prompts, f.min_len, f.max_len, f.tokens, f.max_num_seqs, f.model.max_step_tokens, weights.c_str(),
              f.model.batch_invariant ? ", --batch-invariant" : "");
  if (!diffs.empty()) {
    std::printf("  %6s %6s %10s %8s %8s %12s %6s\n", "prompt", "len", "first diff", "alone", "served", "top-2 gap", "rank");  // rank 0: not in the top 20
    for (const Diff& d : diffs)
      std::printf("  %6d %6d %10d %8d %8d %12.3g %6d\n", d.prompt, d.length, d.at, d.alone_token, d.served_token, d.gap,
                  d.rank);
  }
  std::printf("  %zu of %d prompts (%.1f%%) differ; median top-2 gap over all %zu steps alone: %.3g\n", diffs.size(),
              f.prompts, 100.0 * diffs.size() / f.prompts, all_gaps.size(), median_gap);
  std::printf("  before the first difference, %lld of %lld steps gave the same token another logprob (max |diff| %.3g)"
              "   (%.1f s, %d threads)\n",
              static_cast<long long>(numeric_steps), static_cast<long long>(same_steps), max_logprob_diff, seconds,
              num_threads());
}

void setup_variance(CLI::App& bench) {
  auto f = std::make_shared<VarianceFlags>();
  auto* cmd = bench.add_subcommand("batch-variance",
                                   "How often greedy outputs differ between each prompt alone and all served together");
  f->model.add_to(cmd);
  cmd->add_option("--prompts", f->prompts, "Prompts (synthetic ids, fixed)")->capture_default_str();
  cmd->add_option("--min-len", f->min_len, "Shortest prompt")->capture_default_str();
  cmd->add_option("--max-len", f->max_len, "Longest prompt")->capture_default_str();
  cmd->add_option("-n,--max-new-tokens", f->tokens, "Greedy tokens per prompt")->capture_default_str();
  cmd->add_option("--max-num-seqs", f->max_num_seqs, "Sequences served at once (as serve)")->capture_default_str();
  cmd->add_option("--max-batch-tokens", f->model.max_step_tokens, "Another name of --step-tokens (as serve)");
  cmd->add_flag("--json", f->json, "One JSON object");
  cmd->callback([f] { run_variance(*f); });
}
MOEX_REGISTER_BENCH(setup_variance);

}  // namespace
}  // namespace moex::tools
