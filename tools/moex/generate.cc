// `moex generate`: text in, text out, then prefill and decode throughput.
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <string>

#include "moex/runtime/generation.h"
#include "moex/text/tokenizer.h"
#include "tools/moex/command.h"
#include "tools/moex/model_flags.h"
#include "tools/moex/profile_flags.h"

namespace moex::tools {
namespace {

struct GenerateFlags {
  ModelFlags model;
  std::vector<std::string> prompts;
  int max_new_tokens = 32;
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 0;
  bool ignore_eos = false;
  bool print_ids = false;  // also print the new tokens' ids (text hides which ids invalid UTF-8 came from)
  ProfileFlags profile;
};

// VmRSS (or VmHWM, the peak) of this process (/proc/self/status), in MB; 0 when it cannot be read.
double resident_megabytes(const std::string& field = "VmRSS:") {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == field) {
      double kb = 0;
      status >> kb;
      return kb / 1024;
    }
    status.ignore(1 << 12, '\n');
  }
  return 0;
}

void run_generate(const GenerateFlags& flags) {
  MOEX_CHECK_INPUT(flags.max_new_tokens >= 0, "-n must be >= 0");
  const Tokenizer tokenizer = Tokenizer::for_model(flags.model.model_dir);  // a .gguf vocabulary, tokenizer.json, else tokenizer.model
  std::vector<std::vector<int>> prompts;
  for (const std::string& text : flags.prompts) prompts.push_back(tokenizer.encode(text, /*add_bos=*/true));
  const auto load_start = std::chrono::steady_clock::now();
  auto model = flags.model.load(static_cast<int>(prompts.size()));
  const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
  const double rss_after_load = resident_megabytes(), rss_peak = resident_megabytes("VmHWM:");
  MOEX_CHECK_INPUT(tokenizer.vocab_size() <= model->config().vocab_size, tokenizer.describe(),
                   " has more tokens than config.json's vocab_size ", model->config().vocab_size);
  GenerationOptions options;
  options.max_new_tokens = flags.max_new_tokens;
  options.stop_at_eos = !flags.ignore_eos;
  options.sampler = {flags.temperature, flags.top_k, flags.top_p, flags.seed};
  flags.profile.start();
  // finish() is collective under mpirun: every rank runs it on the way out (rank 0 after printing the text).
  struct FinishProfile {
    const ProfileFlags& profile;
    ~FinishProfile() noexcept(false) {  // a bad --trace path is an error like any other
      if (std::uncaught_exceptions() == 0) profile.finish();
    }
  } finish_profile{flags.profile};
  const GenerationResult result = generate(*model, prompts, options);
  if (model->options().plan.rank != 0) return;  // every rank has the results; one prints them
  if (!model->options().plan.single()) std::printf("plan: %s\n", model->options().plan.describe().c_str());
  for (size_t s = 0; s < prompts.size(); ++s) {
    if (prompts.size() > 1) std::printf("[%zu] ", s);
    // Decode prompt + continuation together: SentencePiece drops a piece's leading space at the start of
    // a decode, so decoding the new tokens alone would glue the first word to the prompt.
    std::vector<int> all = prompts[s];
    all.insert(all.end(), result.new_tokens[s].begin(), result.new_tokens[s].end());
    std::printf("%s\n", tokenizer.decode(all).c_str());
    if (flags.print_ids) {
      std::printf("ids:");
      for (int id : result.new_tokens[s]) std::printf(" %d", id);
      std::printf("\n");
    }
  }
  // A full KV cache ends a sequence short of -n: say so, or the output looks like the model chose to stop.
  for (size_t s = 0; s < prompts.size(); ++s) {
    if (result.stop_reasons[s] != StopReason::kCacheFull) continue;
    std::fprintf(stderr,
                 "moex: note: %sgeneration stopped after %zu of %d new tokens: the prompt (%zu tokens) and the output "
                 "filled the KV cache (--max-seq-len %d); raise --max-seq-len to generate more\n",
                 prompts.size() > 1 ? ("[" + std::to_string(s) + "] ").c_str() : "", result.new_tokens[s].size(),
                 flags.max_new_tokens, prompts[s].size(), model->options().max_seq_len);
  }
  const DecoderWeights& weights = model->weights();
  std::printf("load:    %.3f s (experts %s, dense %s", load_seconds, model->options().expert_weights.name().c_str(),
              model->options().dense_weights.name().c_str());
  if (weights.quantized_checkpoint) std::printf(", quantized checkpoint");
  if (weights.pack_seconds > 0)
    std::printf(weights.panels_mapped ? ", panels.moex mapped in %.3f s" : ", packed in %.3f s", weights.pack_seconds);
  std::printf("), resident %.0f MB after load (peak %.0f MB)\n", rss_after_load, rss_peak);
  std::printf("prefill: %lld tokens in %.3f s = %.1f tokens/s\n", static_cast<long long>(result.prefill_tokens),
              result.prefill_seconds, result.prefill_tokens / std::max(result.prefill_seconds, 1e-9));
  std::printf("decode:  %lld tokens in %.3f s = %.1f tokens/s (%lld steps, batch %zu)\n",
              static_cast<long long>(result.decode_tokens), result.decode_seconds,
              result.decode_tokens / std::max(result.decode_seconds, 1e-9), static_cast<long long>(result.decode_steps),
              prompts.size());
}

void setup_generate(CLI::App& app) {
  auto flags = std::make_shared<GenerateFlags>();
  auto* cmd = app.add_subcommand("generate", "Generate text from a prompt and print the throughput");
  flags->model.add_to(cmd);
  cmd->add_option("--prompt", flags->prompts, "Prompt text (repeat for a batch of sequences)")->required();
  cmd->add_option("-n,--max-new-tokens", flags->max_new_tokens, "Tokens to generate")->capture_default_str();
  cmd->add_option("--temperature", flags->temperature, "0 is greedy")->capture_default_str();
  cmd->add_option("--top-k", flags->top_k, "Keep the k most likely tokens (0: all)")->capture_default_str();
  cmd->add_option("--top-p", flags->top_p, "Nucleus sampling mass")->capture_default_str();
  add_seed_flag(cmd, flags->seed, "Sampling seed");
  cmd->add_flag("--ignore-eos", flags->ignore_eos, "Keep generating after the end-of-sequence token");
  cmd->add_flag("--print-ids", flags->print_ids, "After each sequence's text, a line 'ids: ...' of its new token ids");
  flags->profile.add_to(cmd);
  cmd->callback([flags] { run_generate(*flags); });
}
MOEX_REGISTER_COMMAND(setup_generate);

}  // namespace
}  // namespace moex::tools
