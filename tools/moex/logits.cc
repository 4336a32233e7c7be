// `moex logits`: logits of every prompt position, then of N greedy decode steps, as float32 .npy
// [positions, vocab]; the interface other engines (and the PyTorch reference) are checked against.
#include <sys/stat.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "moex/runtime/generation.h"
#include "moex/runtime/npy.h"
#include "moex/runtime/sampler.h"
#include "tools/lib/output_dir.h"
#include "tools/moex/command.h"
#include "tools/moex/model_flags.h"

namespace moex::tools {
namespace {

struct LogitsFlags {
  ModelFlags model;
  std::vector<int> ids;
  int decode_steps = 0;
  std::string out;
  std::string tokens_out;
  std::string stats_out;
};

// Where one result goes. A regular file (or a new name) is staged beside it and renamed over it once
// complete (tools/lib/output_dir.h), so a failed or interrupted write never leaves half a file under the
// user's name; anything else (a device such as /dev/stdout or /dev/null, a pipe, a symlink) is written in place.
class OutputFile {
 public:
  OutputFile(std::string path, std::string flag) : path_(std::move(path)), flag_(std::move(flag)) {
    struct stat st {};
    if (::lstat(path_.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return;
    named([&] { staged_ = std::make_unique<StagingFile>(path_, "logits"); });
  }
  // Runs `write` on the path to write now.
  void write(const std::function<void(const std::string&)>& write) {
    named([&] { write(staged_ ? staged_->path() : path_); });
  }
  void commit() {
    if (staged_) named([&] { staged_->publish(); });
  }

 private:
  // A failure names the flag and the user's path.
  void named(const std::function<void()>& step) {
    try {
      step();
    } catch (const Error& e) {
      throw Error(e.kind(), flag_ + ": cannot write " + path_ + " (" + e.what() + ")");
    }
  }

  std::string path_, flag_;
  std::unique_ptr<StagingFile> staged_;
};

void write_text_file(const std::string& path, const std::string& text) {
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "w"), &std::fclose);
  MOEX_CHECK_INPUT(file != nullptr, std::strerror(errno));
  bool ok = std::fwrite(text.data(), 1, text.size(), file.get()) == text.size() && std::fflush(file.get()) == 0;
  ok = std::fclose(file.release()) == 0 && ok;
  MOEX_CHECK_INPUT(ok, "short write, disk full?");
}

// The outputs must not overwrite the model they are computed from, nor each other: compared by inode, so a
// symlink or hard link to a model file counts too.
void check_outputs(const std::string& model_dir, const std::vector<std::pair<std::string, std::string>>& outputs) {
  std::vector<std::pair<dev_t, ino_t>> model_files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(model_dir, ec)) {
    struct stat st {};
    if (::stat(entry.path().c_str(), &st) == 0) model_files.emplace_back(st.st_dev, st.st_ino);
  }
  if (struct stat st {}; std::filesystem::is_regular_file(model_dir, ec) && ::stat(model_dir.c_str(), &st) == 0)
    model_files.emplace_back(st.st_dev, st.st_ino);  // a .gguf model is one file
  std::vector<std::tuple<dev_t, ino_t, std::string>> seen;
  std::vector<std::pair<std::string, std::string>> seen_names;
  for (const auto& [flag, path] : outputs) {
    if (path.empty()) continue;
    struct stat st {};
    const bool exists = ::stat(path.c_str(), &st) == 0;
    if (exists && !S_ISREG(st.st_mode)) continue;  // /dev/null twice is fine
    const std::string name = std::filesystem::weakly_canonical(path, ec).string();
    for (const auto& [other_flag, other_name] : seen_names) {
      MOEX_CHECK_INPUT(name != other_name, flag, " and ", other_flag, " name the same file ", path,
                       ": give each output its own file");
    }
    seen_names.emplace_back(flag, name);
    if (!exists) continue;
    for (const auto& [dev, ino] : model_files) {
      MOEX_CHECK_INPUT(dev != st.st_dev || ino != st.st_ino, flag, " ", path, " is a file of the model folder ",
                       model_dir, ": refusing to overwrite it; write the output elsewhere");
    }
    for (const auto& [dev, ino, other_flag] : seen) {
      MOEX_CHECK_INPUT(dev != st.st_dev || ino != st.st_ino, flag, " and ", other_flag, " name the same file ", path,
                       ": give each output its own file");
    }
    seen.emplace_back(st.st_dev, st.st_ino, flag);
  }
}

// Per-layer MoE load of the prompt's forward call, in the keys of tests/reference/mixtral_ref.py --stats-out:
// tokens_per_expert counts routed assignments (before capacity); kept_per_expert what capacity let through.
std::string moe_stats_json(const DecoderModel& model, int64_t tokens) {
  nlohmann::json layers = nlohmann::json::array();
  for (const MoELoadStats& s : model.moe_stats()) {
    std::vector<int> routed(s.tokens_per_expert.size());
    for (size_t e = 0; e < routed.size(); ++e) routed[e] = s.tokens_per_expert[e] + s.drops_per_expert[e];
    layers.push_back({{"tokens_per_expert", routed}, {"kept_per_expert", s.tokens_per_expert},
                      {"drops_per_expert", s.drops_per_expert}, {"drops", s.drops}, {"capacity", s.capacity}});
  }
  const float factor = model.options().capacity_factor;
  const int64_t capacity = MoEDynamicBatch::capacity_for(tokens, model.config().num_local_experts,
                                                         model.config().num_experts_per_tok, factor);
  nlohmann::json report{{"num_tokens", tokens}, {"capacity_factor", factor > 0 ? nlohmann::json(factor) : nullptr},
                        {"capacity", capacity > 0 ? nlohmann::json(capacity) : nullptr}, {"layers", layers}};
  return report.dump(1) + "\n";
}

// NaN or infinite logits come from broken weights (or a bug): an error naming where, never a silent file.
void check_logits_finite(const std::vector<float>& logits, int vocab, size_t prompt_tokens) {
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isfinite(logits[i])) continue;
    const size_t position = i / vocab;
    const std::string step = position < prompt_tokens
                                 ? "prompt token " + std::to_string(position)
                                 : "decode step " + std::to_string(position - prompt_tokens);
    throw_error(ErrorKind::kInvalidInput, "logits at position " + std::to_string(position) + " (" + step +
                                              ") are not finite (" + std::to_string(logits[i]) + " for token " +
                                              std::to_string(i % vocab) +
                                              "): the weights hold NaN or infinity? check with --check-weights");
  }
}

void run_logits(const LogitsFlags& flags) {
  const std::vector<int>& prompt = flags.ids;
  MOEX_CHECK_INPUT(flags.decode_steps >= 0, "--decode must be >= 0");
  check_outputs(flags.model.model_dir,
                {{"--out", flags.out}, {"--tokens-out", flags.tokens_out}, {"--stats-out", flags.stats_out}});
  auto model = flags.model.load(1);
  const int vocab = model->config().vocab_size;
  const int64_t rows = static_cast<int64_t>(prompt.size()) + flags.decode_steps;
  MOEX_CHECK_INPUT(rows <= model->options().max_seq_len, "prompt + --decode is ", rows,
                   " positions: increase --max-seq-len to at least ", rows);
  std::vector<float> logits(static_cast<size_t>(rows) * vocab), last(vocab);
  if (!flags.stats_out.empty())
    MOEX_CHECK_INPUT(static_cast<int64_t>(prompt.size()) <= model->options().max_step_tokens,
                     "--stats-out describes the prompt as one forward call: increase --step-tokens to at least ",
                     prompt.size());
  // Under attention DP the sequence lives on rank 0; the other ranks join each step's collectives.
  const ParallelPlan& plan = model->options().plan;
  const bool owner = rank_serves_sequence(plan, 0);
  KvBlockManager kv = make_block_manager(*model);
  if (owner) {
    prefill(*model, kv, 0, prompt, last.data(), logits.data());
  } else {
    for (int64_t i = 0; i < prefill_steps(*model, static_cast<int64_t>(prompt.size())); ++i) idle_step(*model);
  }
  std::string stats;  // written with the logits, at the end (the decode steps replace the model's stats)
  if (!flags.stats_out.empty() && plan.rank == 0) stats = moe_stats_json(*model, static_cast<int64_t>(prompt.size()));
  std::vector<int> generated;
  for (int step = 0; step < flags.decode_steps; ++step) {
    if (!owner) {
      idle_step(*model);
      continue;
    }
    const int32_t token = argmax(last.data(), vocab);
    const int32_t position = static_cast<int32_t>(prompt.size()) + step;
    generated.push_back(token);
    float* row = logits.data() + static_cast<size_t>(position) * vocab;
    decode_step(*model, kv, {0}, &token, &position, row);
    std::copy(row, row + vocab, last.begin());
  }
  if (plan.rank != 0) return;  // rank 0 serves sequence 0 under every plan and writes the results
  check_logits_finite(logits, vocab, prompt.size());
  // Every output is complete under its temporary name before any replaces the user's file.
  OutputFile out(flags.out, "--out");
  out.write([&](const std::string& path) { write_npy_f32(path, logits.data(), {rows, vocab}); });
  std::unique_ptr<OutputFile> tokens_out, stats_out;
  if (!flags.tokens_out.empty()) {
    std::string text;
    for (int t : generated) text += std::to_string(t) + "\n";
    tokens_out = std::make_unique<OutputFile>(flags.tokens_out, "--tokens-out");
    tokens_out->write([&](const std::string& path) { write_text_file(path, text); });
  }
  if (!flags.stats_out.empty()) {
    stats_out = std::make_unique<OutputFile>(flags.stats_out, "--stats-out");
    stats_out->write([&](const std::string& path) { write_text_file(path, stats); });
  }
  out.commit();
  if (tokens_out) tokens_out->commit();
  if (stats_out) stats_out->commit();
  std::printf("wrote %s: [%lld, %d] float32 (%zu prompt positions, %d decode steps)\n", flags.out.c_str(),
              static_cast<long long>(rows), vocab, prompt.size(), flags.decode_steps);
  if (!model->options().plan.single()) std::printf("plan: %s\n", model->options().plan.describe().c_str());
}

void setup_logits(CLI::App& app) {
  auto flags = std::make_shared<LogitsFlags>();
  auto* cmd = app.add_subcommand("logits", "Write the logits of a prompt (and N greedy decode steps) as .npy");
  flags->model.add_to(cmd);
  add_list_flag(cmd, "--ids", flags->ids, "Prompt token ids")->required()->check(whole_number_in(0, INT32_MAX));
  cmd->add_option("--decode", flags->decode_steps, "Greedy decode steps after the prompt")->capture_default_str();
  add_output_flag(cmd, "--out", flags->out, "Output .npy file: float32 [positions, vocab]")->required();
  add_output_flag(cmd, "--tokens-out", flags->tokens_out, "Also write the greedy tokens, one per line");
  add_output_flag(cmd, "--stats-out", flags->stats_out, "Also write the prompt pass's per-layer MoE load and drops (JSON)");
  cmd->callback([flags] { run_logits(*flags); });
}
MOEX_REGISTER_COMMAND(setup_logits);

}  // namespace
}  // namespace moex::tools
