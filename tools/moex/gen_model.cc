// `moex gen-model`: writes a synthetic checkpoint of any family in Hugging Face layout (config.json,
// safetensors, tokenizer.model or a byte-level tokenizer.json, tokenizer_config.json, generation_config.json)
// so that the loader that reads it also reads a real downloaded model of that family.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <thread>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/model/config.h"
#include "tools/lib/output_dir.h"
#include "tools/lib/safetensors_writer.h"
#include "tools/lib/synthetic.h"
#include "tools/lib/tokenizer_train.h"
#include "tools/moex/command.h"
#include "tools/moex/flags.h"

namespace moex::tools {
namespace {

struct GenModelOptions {
  std::string preset;
  std::string out;
  int layers = 0, hidden = 0, intermediate = 0, heads = 0, kv_heads = 0, experts = 0, top_k = 0, vocab = 0;
  uint64_t seed = 0;
  float router_skew = 0;
  std::string dtype = "bf16";
  std::string max_shard_size = "2GB";
  ThreadsFlags threads;
  bool force = false;
  std::set<std::string> given;  // override flags present on the command line (so "--layers 0" is an error)
};

// --dtype: the file dtype, spelled like --comm-dtype and the comm tuning tables (f32, bf16: safetensors'
// F32 / BF16 in lower case), with config.json's torch_dtype for it.
struct WeightDType {
  const char* flag;
  DType dtype;
  const char* torch_dtype;
};
constexpr WeightDType kWeightDTypes[] = {{"bf16", DType::kBF16, "bfloat16"}, {"f32", DType::kF32, "float32"}};

const WeightDType& weight_dtype(const std::string& name) {
  for (const WeightDType& d : kWeightDTypes)
    if (name == d.flag) return d;
  throw_error(ErrorKind::kInvalidInput, "--dtype: '" + name + "' is not one of bf16, f32");
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  MOEX_CHECK_INPUT(out.good(), "cannot write ", path, " (is --out writable?)");
  out << text;
  out.close();
  MOEX_CHECK_INPUT(out.good(), "cannot write ", path, " (disk full?)");
}

ModelConfig build_config(const GenModelOptions& o) {
  ModelConfig c = synthetic_preset(o.preset);
  auto override_size = [&](int value, const char* flag, int* field) {
    if (!o.given.count(flag)) return;
    MOEX_CHECK_INPUT(value > 0, flag, " must be >= 1 (got ", value, ")");
    *field = value;
  };
  override_size(o.hidden, "--hidden", &c.hidden_size);
  override_size(o.intermediate, "--intermediate", &c.intermediate_size);
  override_size(o.heads, "--heads", &c.num_attention_heads);
  override_size(o.kv_heads, "--kv-heads", &c.num_key_value_heads);
  override_size(o.experts, "--experts", &c.num_local_experts);
  override_size(o.top_k, "--top-k", &c.num_experts_per_tok);
  override_size(o.vocab, "--vocab", &c.vocab_size);
  override_size(o.layers, "--layers", &c.num_hidden_layers);
  MOEX_CHECK_INPUT(c.hidden_size % c.num_attention_heads == 0, "--hidden ", c.hidden_size,
                   " must be a multiple of the number of heads (", c.num_attention_heads, ")");
  if (o.given.count("--hidden") || o.given.count("--heads")) c.head_dim = c.hidden_size / c.num_attention_heads;
  // Family fields that follow the sizes: dots1's shared experts are n_shared_experts experts wide; a cut
  // --layers drops the dense layers it no longer has.
  if (c.n_shared_experts > 0) c.shared_expert_intermediate_size = c.n_shared_experts * c.intermediate_size;
  c.first_k_dense_replace = std::min(c.first_k_dense_replace, c.num_hidden_layers);
  c.mlp_only_layers.erase(std::remove_if(c.mlp_only_layers.begin(), c.mlp_only_layers.end(),
                                         [&](int l) { return l >= c.num_hidden_layers; }),
                          c.mlp_only_layers.end());
  MOEX_CHECK_INPUT(c.vocab_size >= 384, "--vocab ", c.vocab_size,
                   " is too small for a byte-fallback tokenizer (use at least 384)");
  c.torch_dtype = weight_dtype(o.dtype).torch_dtype;
  validate_model_config(c);
  return c;
}

std::string human_bytes(double bytes) {
  char text[32];
  if (bytes >= 1e9) std::snprintf(text, sizeof(text), "%.2f GB", bytes / 1e9);
  else if (bytes >= 1e6) std::snprintf(text, sizeof(text), "%.1f MB", bytes / 1e6);
  else std::snprintf(text, sizeof(text), "%.1f KB", bytes / 1e3);
  return text;
}

std::string human_count(double n) {
  char text[32];
  if (n >= 1e9) std::snprintf(text, sizeof(text), "%.2fB", n / 1e9);
  else if (n >= 1e6) std::snprintf(text, sizeof(text), "%.1fM", n / 1e6);
  else std::snprintf(text, sizeof(text), "%.1fK", n / 1e3);
  return text;
}

bool is_weight_file(const std::string& name) {
  static const std::regex kWeightFile(R"(model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?)");
  return std::regex_match(name, kWeightFile);
}

// The files gen-model writes besides the weights.
const std::set<std::string>& side_files() {
  static const std::set<std::string> names = {"config.json", "generation_config.json", "tokenizer_config.json",
                                              "tokenizer.model", "tokenizer.json"};
  return names;
}

// --force keeps what --out holds besides a model (a README, notes): hard links into the staged folder.
// A sub-folder would have to be moved, which is not atomic: refused before anything is written.
std::vector<std::string> files_to_keep(const std::filesystem::path& out) {
  std::vector<std::string> keep;
  for (const auto& entry : std::filesystem::directory_iterator(out)) {
    const std::string name = entry.path().filename().string();
    if (is_weight_file(name) || side_files().count(name)) continue;
    MOEX_CHECK_INPUT(entry.is_symlink() || !entry.is_directory(), "--out ", out.string(), " holds a folder '", name,
                     "' that gen-model would not keep: move it away, or choose another --out");
    keep.push_back(name);
  }
  return keep;
}

void run_gen_model(const GenModelOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  o.threads.apply();
  const DType dtype = weight_dtype(o.dtype).dtype;
  const ModelConfig config = build_config(o);
  const uint64_t max_shard = parse_byte_size(o.max_shard_size, "--max-shard-size");

  namespace fs = std::filesystem;
  const fs::path out = prepare_output_dir(o.out, o.force);
  const std::vector<std::string> keep = fs::exists(out) ? files_to_keep(out) : std::vector<std::string>();

  const SyntheticModel model(config, o.seed, o.router_skew, dtype);
  const SafetensorsPlan plan = plan_safetensors(model.tensors(), max_shard, model.checkpoint_id(),
                                                    SafetensorsOptions{.metadata = {}, .data_alignment = kPageDataAlignment});
  uint64_t file_bytes = 0;
  for (const auto& shard : plan.shards) file_bytes += shard.file_size;
  struct statvfs fs_stat {};
  if (::statvfs(out.parent_path().c_str(), &fs_stat) == 0) {  // the old model stays until the new one is complete
    const double free_bytes = static_cast<double>(fs_stat.f_bavail) * fs_stat.f_frsize;
    MOEX_CHECK_INPUT(free_bytes > static_cast<double>(file_bytes), "--out: the weights need ",
                     human_bytes(static_cast<double>(file_bytes)), " but ", out.parent_path().string(), " has ",
                     human_bytes(free_bytes), " free (cut the depth with --layers)");
  }
  StagingDir staging(out, "gen-model");
  const std::string dir = staging.path().string();
  for (const std::string& name : keep) {
    MOEX_CHECK_INPUT(::linkat(AT_FDCWD, (out / name).c_str(), AT_FDCWD, (staging.path() / name).c_str(), 0) == 0,
                     "--out: cannot keep ", (out / name).string(), " (", std::strerror(errno),
                     "): move it away, or choose another --out");
  }

  // The tokenizer trains (~0.5 s, one thread) while the weights are generated: Mixtral's SentencePiece
  // tokenizer.model (and the tokenizer.json converted from it, as HF's Mixtral ships both), or the byte-level
  // BPE tokenizer.json of the other families (docs/model.md), whose special-token ids config.json then names.
  const TokenizerKind tokenizer_kind = config.info().tokenizer;
  const bool byte_level = tokenizer_kind != TokenizerKind::kSentencePiece;
  TrainedTokenizer tokenizer;
  TrainedByteLevelBpe bpe;
  std::exception_ptr tokenizer_error;
  std::thread tokenizer_thread([&] {
    try {
      if (byte_level) {
        bpe = train_byte_level_bpe(
            family_tokenizer_options(config.model_type, config.vocab_size, config.max_position_embeddings));
      } else {
        tokenizer = train_builtin_tokenizer(config.vocab_size);
      }
    } catch (...) {
      tokenizer_error = std::current_exception();
    }
  });
  struct Joiner {
    std::thread& thread;
    ~Joiner() { if (thread.joinable()) thread.join(); }
  } joiner{tokenizer_thread};

  const auto weights_start = std::chrono::steady_clock::now();
  write_safetensors(dir, model.tensors(), plan, model.filler(), 64ull << 20, "generating weights");
  const double weights_seconds = seconds_since(weights_start);
  tokenizer_thread.join();
  if (tokenizer_error) std::rethrow_exception(tokenizer_error);
  ModelConfig written = config;
  if (byte_level) {
    // config.json's ids are the tokenizer's: Qwen's bos_token_id is <|endoftext|> (its tokenizer adds no BOS),
    // OLMoE has none; eos is tokenizer_config.json's eos_token; pad as the family ships it.
    const ByteLevelBpeOptions options =
        family_tokenizer_options(config.model_type, config.vocab_size, config.max_position_embeddings);
    written.eos_token_id = bpe.id_of(options.eos_token);
    written.has_bos = tokenizer_kind != TokenizerKind::kGpt2ByteLevel;
    written.bos_token_id = written.has_bos ? bpe.id_of("<|endoftext|>") : -1;
    if (config.pad_token_id >= 0) written.pad_token_id = bpe.id_of(options.pad_token);
    validate_model_config(written);
    write_text(dir + "/tokenizer.json", bpe.tokenizer_json);
    write_text(dir + "/tokenizer_config.json", bpe.tokenizer_config_json);
  } else {
    write_text(dir + "/tokenizer.model", tokenizer.model_proto);
    write_text(dir + "/tokenizer.json", mixtral_tokenizer_json(tokenizer.model_proto));
    write_text(dir + "/tokenizer_config.json", llama_tokenizer_config_json(config.max_position_embeddings));
  }
  write_text(dir + "/config.json", model_config_to_json(written));
  write_text(dir + "/generation_config.json", generation_config_json(written));
  staging.publish(out);
  const double total_seconds = seconds_since(start);

  const ModelConfig& c = config;
  std::printf("moex gen-model: preset %s, seed %llu -> %s\n", o.preset.c_str(),
              static_cast<unsigned long long>(o.seed), o.out.c_str());
  std::printf("  config       hidden %d, intermediate %d, %d layers, %d heads (%d KV, head_dim %d), %d experts top-%d, vocab %d\n",
              c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
              c.head_dim, c.num_local_experts, c.num_experts_per_tok, c.vocab_size);
  std::printf("  parameters   %s total, %s active per token\n", human_count(static_cast<double>(c.total_params())).c_str(),
              human_count(static_cast<double>(c.active_params_per_token())).c_str());
  std::printf("  weights      %s, %s in %zu file%s (%s)\n", std::string(dtype_name(dtype)).c_str(),
              human_bytes(static_cast<double>(file_bytes)).c_str(), plan.shards.size(), plan.shards.size() == 1 ? "" : "s",
              plan.shards.size() == 1 ? "model.safetensors" : "model-*-of-*.safetensors + model.safetensors.index.json");
  if (byte_level) {
    std::printf("  tokenizer    byte-level BPE (tokenizer.json), %d tokens (%d merges), eos id %d\n", bpe.vocab_size,
                bpe.merges, written.eos_token_id);
  } else {
    std::printf("  tokenizer    SentencePiece BPE with byte fallback, %d pieces", tokenizer.vocab_size);
  }
  if (!byte_level && tokenizer.trained_pieces < tokenizer.vocab_size) {
    std::printf(" (%d trained merges + %d frequent word pairs)", tokenizer.trained_pieces,
                tokenizer.vocab_size - tokenizer.trained_pieces);
  }
  if (!byte_level) std::printf("\n");
  const RouterSkewReport& skew = model.router_skew();
  std::printf("  router load  skew %.2f; measured at layer 0 on %d normalised embedding rows, top-%d: max/mean %.2f, min/mean %.2f\n",
              skew.skew, skew.tokens, c.num_experts_per_tok, skew.max_over_mean, skew.min_over_mean);
  std::printf("               share per expert  ");
  for (double s : skew.measured_share) std::printf(" %.3f", s);
  std::printf("\n");
  if (skew.skew > 0) {
    std::printf("               Zipf target       ");
    for (double s : skew.target_share) std::printf(" %.3f", s);
    std::printf("\n");
  }
  std::printf("  time         %.1f s (weights %.1f s, %s/s, %d threads)\n", total_seconds, weights_seconds,
              human_bytes(static_cast<double>(file_bytes) / std::max(weights_seconds, 1e-9)).c_str(), num_threads());
}

void setup_gen_model(CLI::App& app) {
  auto options = std::make_shared<GenModelOptions>();
  auto* cmd = app.add_subcommand("gen-model", "Write a synthetic checkpoint of a preset (any family) in Hugging Face layout");
  std::string presets;
  for (const std::string& name : synthetic_preset_names()) presets += (presets.empty() ? "" : " | ") + name;
  cmd->add_option("--preset", options->preset, presets)->required();
  add_output_flag(cmd, "--out", options->out,
                  "Output directory (created if missing; must be empty unless --force). The model is written into a "
                  "folder next to it and moved in when complete")
      ->required();
  cmd->add_flag("--force", options->force,
                "Replace the model in a non-empty --out (other files there are kept; old shards are replaced "
                "by new files, never rewritten in place)");
  cmd->add_option("--layers", options->layers, "Number of layers (cuts or extends the preset's depth)");
  add_seed_flag(cmd, options->seed, "Weights are a pure function of the seed");
  add_quiet_flag(cmd);
  cmd->add_option("--router-skew", options->router_skew,
                  "Zipf exponent S of expert popularity: expert e gets a share ~ 1/(e+1)^S (0 = balanced; at most 16: "
                  "the calibration stays finite to ~300, and past 16 the tail experts already get no tokens)");
  cmd->add_option("--dtype", options->dtype, "bf16 (default) or f32");
  cmd->add_option("--max-shard-size", options->max_shard_size,
                  "Split the safetensors above this size, as transformers does (default 2GB = 2e9 bytes)");
  cmd->add_option("--hidden", options->hidden, "Override hidden_size");
  cmd->add_option("--intermediate", options->intermediate, "Override intermediate_size");
  cmd->add_option("--heads", options->heads, "Override num_attention_heads");
  cmd->add_option("--kv-heads", options->kv_heads, "Override num_key_value_heads");
  cmd->add_option("--experts", options->experts, "Override num_local_experts");
  cmd->add_option("--top-k", options->top_k, "Override num_experts_per_tok");
  cmd->add_option("--vocab", options->vocab, "Override vocab_size (>= 384)");
  options->threads.add_to(cmd);
  cmd->callback([options, cmd] {
    for (const char* flag : {"--layers", "--hidden", "--intermediate", "--heads", "--kv-heads", "--experts", "--top-k", "--vocab"}) {
      if (cmd->count(flag)) options->given.insert(flag);
    }
    run_gen_model(*options);
  });
}
MOEX_REGISTER_COMMAND(setup_gen_model);

}  // namespace
}  // namespace moex::tools
