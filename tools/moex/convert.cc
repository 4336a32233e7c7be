// `moex convert --model DIR --out FILE.gguf [--type T] [--force]`: a Hugging Face folder (any family) written as
// the GGUF file llama.cpp's converter would write (tools/lib/gguf_writer.h). The file is written in a folder
// beside --out and renamed when complete (tools/lib/output_dir.h), so an interrupted run leaves --out as it
// was, and a reader that has the old file mapped keeps its bytes (a new inode replaces it).
#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "moex/base/threads.h"
#include "tools/lib/gguf_writer.h"
#include "tools/lib/output_dir.h"
#include "tools/moex/command.h"
#include "tools/moex/flags.h"

namespace moex::tools {
namespace {

struct ConvertOptions {
  std::string model, out, type = "bf16";
  bool force = false;
};

void run_convert(const ConvertOptions& o) {
  namespace fs = std::filesystem;
  GgmlType type;
  MOEX_CHECK_INPUT(gguf_convert_type(o.type, &type), "--type ", o.type, ": use f32, f16, bf16, q8_0, q4_0 or q4_K");
  MOEX_CHECK_INPUT(o.out.size() > 5 && o.out.substr(o.out.size() - 5) == ".gguf", "--out ", o.out,
                   " must name a .gguf file");
  MOEX_CHECK_INPUT(fs::is_directory(o.model), "--model ", o.model, " is not a model folder");
  struct stat st {};
  if (::lstat(o.out.c_str(), &st) == 0) {
    MOEX_CHECK_INPUT(S_ISREG(st.st_mode), "--out ", o.out, " exists and is not a regular file: refusing to replace it");
    MOEX_CHECK_INPUT(o.force, "--out ", o.out, " exists: pass --force to replace it");
  }
  const auto start = std::chrono::steady_clock::now();
  StagingFile staged(o.out, "convert");
  const std::string summary = convert_to_gguf(o.model, staged.path(), type);
  staged.publish();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("wrote %s (%.1f MB, %s tensors) in %.1f s\n", o.out.c_str(), fs::file_size(o.out) / 1e6, summary.c_str(),
              seconds);
}

void setup_convert(CLI::App& app) {
  auto options = std::make_shared<ConvertOptions>();
  auto* cmd = app.add_subcommand("convert", "Write a Hugging Face model folder as a llama.cpp GGUF file");
  cmd->add_option("--model", options->model, "Hugging Face model folder (config.json, safetensors, tokenizer.model)")
      ->required();
  add_output_flag(cmd, "--out", options->out, "The .gguf file to write (written beside, then renamed)")->required();
  cmd->add_option("--type", options->type,
                  "Weight matrices: f32 | f16 | bf16 | q8_0 | q4_0 | q4_K (norms and the router stay f32; rows that "
                  "are not whole blocks fall back to q8_0, then f16)")
      ->capture_default_str();
  cmd->add_flag("--force", options->force, "Replace an existing --out (by a new file, never rewritten in place)");
  add_quiet_flag(cmd);
  cmd->callback([options] { run_convert(*options); });
}
MOEX_REGISTER_COMMAND(setup_convert);

}  // namespace
}  // namespace moex::tools
