// `moex quantize`: writes a quantized copy of a bf16/f32 checkpoint in the compressed-tensors convention
// (docs/kernels.md, "Quantized checkpoints"), which HF transformers and vLLM read and MoEX loads with no
// quantization at start-up: the experts and attention projections quantized (int8 per channel, int4 per
// group of --group-size, fp8 e4m3 per 128x128 block), the router, lm_head, embeddings and norms as stored.
#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>

#include "moex/base/error.h"
#include "moex/base/mapped_file.h"
#include "moex/base/threads.h"
#include "moex/kernels/packed.h"
#include "moex/model/config.h"
#include "moex/model/panels_file.h"
#include "moex/model/quantization.h"
#include "moex/model/safetensors.h"
#include "tools/lib/output_dir.h"
#include "tools/lib/panels_writer.h"
#include "tools/lib/safetensors_writer.h"
#include "tools/moex/command.h"
#include "tools/moex/flags.h"

namespace moex::tools {
namespace {

namespace fs = std::filesystem;
using kernels::QuantizedMatrix;
using kernels::WeightFormat;

struct QuantizeOptions {
  std::string model_dir, out, weights, max_shard_size = "2GB";
  int group_size = 128;
  CLI::Option* group_size_option = nullptr;
  bool force = false;
  ThreadsFlags threads;
};

// The linear modules of a Mixtral checkpoint, by their weight's name.
bool is_linear_weight(const std::string& name, std::string* module) {
  static const std::regex kLinear(
      R"((model\.layers\.\d+\.(self_attn\.[qkvo]_proj|block_sparse_moe\.gate|block_sparse_moe\.experts\.\d+\.w[123])|lm_head)\.weight)");
  std::smatch m;
  if (!std::regex_match(name, m, kLinear)) return false;
  *module = m[1].str();
  return true;
}

bool is_weight_file(const std::string& name) {
  static const std::regex kWeightFile(R"(model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?)");
  return std::regex_match(name, kWeightFile) || name == kPanelsFileName;
}

// One output tensor: a copy of a source tensor, or one part of a quantized module.
enum class Part { kCopy, kCodes, kPacked, kScale, kShape };
struct OutTensor {
  Part part = Part::kCopy;
  std::string source;  // the source tensor (the module's .weight for the quantized parts)
};

void write_file_copy(const fs::path& from, const fs::path& to) {
  std::ifstream in(from, std::ios::binary);
  std::ofstream out(to, std::ios::binary | std::ios::trunc);
  MOEX_CHECK_INPUT(in.good() && out.good(), "cannot copy ", from.string(), " to ", to.string());
  out << in.rdbuf();
  out.close();
  MOEX_CHECK_INPUT(out.good(), "cannot write ", to.string(), " (disk full?)");
}

void run_quantize(const QuantizeOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  o.threads.apply();
  MOEX_CHECK_INPUT(o.group_size_option == nullptr || o.group_size_option->count() == 0 || o.weights == "int4",
                   "--group-size applies to --weights int4 only (got --weights ", o.weights, ")");
  const WeightFormat format = *kernels::weight_format_from_name(o.weights);  // (a member of quantize_names())
  ModelConfig config = load_model_config(o.model_dir + "/config.json");
  // The module names below are Mixtral's; the other families (shared experts, dense MLP layers, other expert
  // names) would be written half quantized, which their loader would then refuse.
  MOEX_CHECK_INPUT(config.family == ModelFamily::kMixtral, "moex quantize writes mixtral checkpoints only so far; ",
                   o.model_dir, " is model_type \"", config.model_type, "\" (use --weights at load instead)");
  MOEX_CHECK_INPUT(!config.quantization.quantized(), o.model_dir,
                   "/config.json has a quantization_config: the checkpoint is quantized already (quantize a bf16 or "
                   "f32 checkpoint)");
  config.quantization = compressed_tensors_config(format, kernels::group_is_user_set(format) ? o.group_size : 0);
  const QuantScheme& scheme = config.quantization.schemes.at(0);
  const WeightStore store(o.model_dir);

  const fs::path out = prepare_output_dir(o.out, o.force);
  std::error_code ec;
  MOEX_CHECK_INPUT(!fs::equivalent(out, fs::path(o.model_dir), ec), "--out ", o.out,
                   " is the --model folder: write the quantized checkpoint to another folder");

  // The tensors to write, in the source's order; a quantized module's parts replace its .weight.
  std::vector<TensorToWrite> tensors;
  std::vector<OutTensor> parts;
  int64_t quantized_modules = 0;
  for (const auto& [name, view] : store.tensors()) {
    std::string module;
    const bool linear = is_linear_weight(name, &module);
    if (!linear || !config.quantization.scheme_for(module)) {
      MOEX_CHECK_INPUT(view.row_stride == 0 || view.row_stride == view.shape[view.shape.rank - 1], "tensor ", name,
                       " is not contiguous");
      TensorToWrite t{name, view.dtype, {}};
      for (int i = 0; i < view.shape.rank; ++i) t.shape.push_back(view.shape[i]);
      tensors.push_back(t);
      parts.push_back({Part::kCopy, name});
      continue;
    }
    MOEX_CHECK_INPUT(view.shape.rank == 2 && (view.dtype == DType::kBF16 || view.dtype == DType::kF32), "tensor ", name,
                     " is ", dtype_name(view.dtype), " ", view.shape.str(), ": quantize reads BF16 or F32 matrices");
    const int64_t rows = view.shape[0], cols = view.shape[1];
    ++quantized_modules;
    const auto add = [&](const std::string& suffix, DType dtype, std::vector<int64_t> shape, Part part) {
      tensors.push_back({module + suffix, dtype, std::move(shape)});
      parts.push_back({part, name});
    };
    switch (format) {
      case WeightFormat::kInt8:  // int-quantized (W8A8: the same tensors, input_activations in the config)
      case WeightFormat::kInt8W8A8:
        add(".weight", DType::kI8, {rows, cols}, Part::kCodes);
        add(".weight_scale", DType::kF32, {rows, 1}, Part::kScale);
        break;
      case WeightFormat::kInt4:  // pack-quantized
        add(".weight_packed", DType::kI32, {rows, (cols + 7) / 8}, Part::kPacked);
        add(".weight_scale", DType::kF32, {rows, (cols + o.group_size - 1) / o.group_size}, Part::kScale);
        add(".weight_shape", DType::kI64, {2}, Part::kShape);
        break;
      default:  // float-quantized
        add(".weight", DType::kF8E4M3, {rows, cols}, Part::kCodes);
        add(".weight_scale", DType::kF32, {(rows + 127) / 128, (cols + 127) / 128}, Part::kScale);
        break;
    }
  }

  std::random_device entropy;
  char id[40];
  std::snprintf(id, sizeof(id), "quantize-%08x%08x", entropy(), entropy());
  const SafetensorsPlan plan = plan_safetensors(tensors, parse_byte_size(o.max_shard_size, "--max-shard-size"), id,
                                                    SafetensorsOptions{.metadata = {}, .data_alignment = kPageDataAlignment});
  uint64_t file_bytes = 0;
  for (const auto& shard : plan.shards) file_bytes += shard.file_size;
  struct statvfs fs_stat {};
  if (::statvfs(out.parent_path().c_str(), &fs_stat) == 0) {
    const double free_bytes = static_cast<double>(fs_stat.f_bavail) * fs_stat.f_frsize;
    // panels.moex holds the same codes and scales again, padded to 64-row panels: about as many bytes.
    const double need = 2.1 * static_cast<double>(file_bytes);
    MOEX_CHECK_INPUT(free_bytes > need, "--out: the quantized weights and their panels.moex need about ",
                     need / 1e6, " MB but ", out.parent_path().string(), " has ", free_bytes / 1e6, " MB free");
  }

  StagingDir staging(out, "quantize");
  // Side files (tokenizer, generation config, notes) are copied; config.json gets the quantization_config.
  for (const auto& entry : fs::directory_iterator(o.model_dir)) {
    const std::string file = entry.path().filename().string();
    if (!entry.is_regular_file() || is_weight_file(file) || file == "config.json") continue;
    write_file_copy(entry.path(), staging.path() / file);
  }
  // --force keeps what --out holds besides a model (notes, a README): hard links into the staged folder.
  if (fs::exists(out)) {
    for (const auto& entry : fs::directory_iterator(out)) {
      const std::string file = entry.path().filename().string();
      if (is_weight_file(file) || file == "config.json" || fs::exists(staging.path() / file)) continue;
      MOEX_CHECK_INPUT(entry.is_symlink() || !entry.is_directory(), "--out ", out.string(), " holds a folder '", file,
                       "' that quantize would not keep: move it away, or choose another --out");
      MOEX_CHECK_INPUT(::linkat(AT_FDCWD, entry.path().c_str(), AT_FDCWD, (staging.path() / file).c_str(), 0) == 0,
                       "--out: cannot keep ", entry.path().string(), ": move it away, or choose another --out");
    }
  }
  {
    std::ofstream cfg(staging.path() / "config.json", std::ios::binary | std::ios::trunc);
    cfg << model_config_to_json(config);
    cfg.close();
    MOEX_CHECK_INPUT(cfg.good(), "cannot write ", (staging.path() / "config.json").string());
  }

  // A module is quantized once, when the first of its parts is written (its parts are adjacent in a shard).
  std::string cached_source;
  QuantizedMatrix q;
  std::vector<uint8_t> bytes;  // the current output tensor's bytes
  size_t cached_tensor = SIZE_MAX;
  const auto fill = [&](size_t index, uint64_t begin, uint8_t* dst, uint64_t size) {
    const OutTensor& part = parts[index];
    const TensorView& src = store.get(part.source);
    if (part.part == Part::kCopy) {
      std::memcpy(dst, static_cast<const uint8_t*>(src.data) + begin, size);
      MappedFile::release(static_cast<const uint8_t*>(src.data) + begin, size);  // read once: drop the pages
      return;
    }
    if (part.source != cached_source) {
      q = kernels::quantize(src, format, o.group_size);  // (symmetric; the group applies to grouped formats only)
      MappedFile::release(src.data, src.bytes());
      cached_source = part.source;
      cached_tensor = SIZE_MAX;
    }
    if (cached_tensor != index) {
      const TensorToWrite& t = tensors[index];
      bytes.assign(t.num_bytes(), 0);
      switch (part.part) {
        case Part::kCodes: std::memcpy(bytes.data(), q.codes.data(), q.codes.size()); break;
        case Part::kScale: std::memcpy(bytes.data(), q.scales.data(), q.scales.size() * sizeof(float)); break;
        case Part::kShape: {
          const int64_t shape[2] = {q.rows, q.cols};
          std::memcpy(bytes.data(), shape, sizeof(shape));
          break;
        }
        case Part::kPacked: {  // code c of a row at bits 4 (c % 8) of word c / 8; codes are signed + 8 (0..15)
          const int64_t words = (q.cols + 7) / 8;
          auto* out_words = reinterpret_cast<uint32_t*>(bytes.data());
          parallel_for(q.rows, 16, [&](int64_t r0, int64_t r1) {
            for (int64_t r = r0; r < r1; ++r)
              for (int64_t c = 0; c < q.cols; ++c)
                out_words[r * words + c / 8] |= uint32_t{q.codes[r * q.cols + c]} << (4 * (c % 8));
          });
          break;
        }
        case Part::kCopy: break;
      }
      cached_tensor = index;
    }
    std::memcpy(dst, bytes.data() + begin, size);
  };
  write_safetensors(staging.path().string(), tensors, plan, fill, 64ull << 20, "quantizing");
  const auto panels_start = std::chrono::steady_clock::now();
  const uint64_t panels_bytes = write_panels(staging.path().string()).bytes;
  const double panels_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - panels_start).count();
  staging.publish(out);

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("moex quantize: %s -> %s\n", o.model_dir.c_str(), o.out.c_str());
  std::printf("  format       compressed-tensors %s (%s), %lld modules quantized (experts, attention); router, "
              "lm_head, embeddings and norms as stored\n",
              scheme.format.c_str(), o.weights == "int4" ? ("int4 symmetric, group " + std::to_string(o.group_size)).c_str()
                                     : o.weights == "int8" ? "int8 symmetric, per output channel"
                                     : o.weights == "int8-w8a8"
                                         ? "int8 symmetric, per output channel; activations int8 per token at run time"
                                         : "fp8 e4m3, per 128x128 block",
              static_cast<long long>(quantized_modules));
  std::printf("  weights      %.1f MB in %zu file%s (source %.1f MB)\n", file_bytes / 1e6, plan.shards.size(),
              plan.shards.size() == 1 ? "" : "s", store.file_bytes() / 1e6);
  std::printf("  panels       %s, %.1f MB: the kernels' packed layout, which a load maps instead of packing (%.1f s)\n",
              kPanelsFileName, panels_bytes / 1e6, panels_seconds);
  std::printf("  time         %.1f s, %d threads\n", seconds, num_threads());
}

// --weights' values: the formats compressed-tensors can hold (model/quantization.h), by the format table's names.
std::vector<std::string> quantize_names() {
  std::vector<std::string> names;
  for (WeightFormat f : compressed_tensors_formats()) {
    names.emplace_back(kernels::weight_format_name(f));
    if (!kernels::format_traits(f).alias.empty()) names.emplace_back(kernels::format_traits(f).alias);  // "fp8"
  }
  return names;
}

void setup_quantize(CLI::App& app) {
  auto o = std::make_shared<QuantizeOptions>();
  auto* cmd = app.add_subcommand("quantize", "Write a quantized checkpoint (compressed-tensors) that loads with no work at start-up");
  cmd->add_option("--model", o->model_dir, "Hugging Face model folder (bf16 or f32 safetensors)")->required();
  cmd->add_option("--weights", o->weights, "int8 (per channel, weight-only) | int8-w8a8 (int8 per channel; activations int8 per token at run time: llm-compressor's W8A8) | int4 (symmetric, per --group-size) | fp8 (e4m3, 128x128 blocks)")
      ->required()
      ->check(CLI::IsMember(quantize_names()));
  o->group_size_option = cmd->add_option("--group-size", o->group_size, "int4: weights per scale along K (32 | 64 | 128)")
                             ->capture_default_str()
                             ->check(CLI::IsMember({32, 64, 128}));
  add_output_flag(cmd, "--out", o->out,
                  "Output folder (created if missing; must be empty unless --force). Written next to it and moved in "
                  "when complete")
      ->required();
  cmd->add_flag("--force", o->force, "Replace what a non-empty --out holds (swapped atomically when complete)");
  add_quiet_flag(cmd);
  cmd->add_option("--max-shard-size", o->max_shard_size, "Split the safetensors above this size (default 2GB)");
  o->threads.add_to(cmd);
  cmd->callback([o] { run_quantize(*o); });
}
MOEX_REGISTER_COMMAND(setup_quantize);

}  // namespace
}  // namespace moex::tools
