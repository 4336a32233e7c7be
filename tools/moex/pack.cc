// `moex pack`: writes panels.moex (model/panels_file.h) for a checkpoint, so that its loads map the packed panels
// instead of packing at start-up: beside a quantized checkpoint that did not come from `moex quantize` (an
// llm-compressor checkpoint, a DeepSeek-style FP8 one), or for a bf16/f16/f32 checkpoint the bf16 panels of
// everything `--weights auto` packs. Beside the checkpoint by default; --out elsewhere (a read-only model folder),
// which the model commands then take as --panels (docs/kernels.md, "panels.moex").
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/model/config.h"
#include "moex/model/panels_file.h"
#include "tools/lib/panels_writer.h"
#include "tools/moex/command.h"
#include "tools/moex/flags.h"

namespace moex::tools {
namespace {

struct PackOptions {
  std::string model_dir, out;
  bool force = false;
  ThreadsFlags threads;
};

void run_pack(const PackOptions& o) {
  namespace fs = std::filesystem;
  const auto start = std::chrono::steady_clock::now();
  o.threads.apply();
  std::error_code ec;
  MOEX_CHECK_INPUT(fs::is_directory(o.model_dir, ec), "--model ", o.model_dir, " is not a model folder");
  const std::string path = o.out.empty() ? default_panels_path(o.model_dir) : o.out;
  MOEX_CHECK_INPUT(!fs::is_directory(path, ec), "--out ", path, " is a folder: name the file to write (e.g. ",
                   (fs::path(path) / kPanelsFileName).string(), ")");
  MOEX_CHECK_INPUT(o.force || !fs::exists(path, ec), path,
                   " exists: pass --force to replace it (it is written anew, then renamed over the old one)");
  // (access() reports a read-only file system to root too; a folder's permission bits do not stop root.)
  const fs::path parent = fs::absolute(path, ec).parent_path();
  MOEX_CHECK_INPUT(fs::is_directory(parent, ec), "cannot write ", path, ": the folder ", parent.string(), " does not exist");
  MOEX_CHECK_INPUT(::access(parent.c_str(), W_OK) == 0, "cannot write ", path, " (", parent.string(), " is read-only",
                   o.out.empty() ? "): write the panels elsewhere with moex pack --out PATH and load with --panels PATH"
                                 : ")");
  const bool quantized = load_model_config((fs::path(o.model_dir) / "config.json").string()).quantization.quantized();
  const PanelsWritten written = write_panels(o.model_dir, o.out);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("moex pack: %s\n  panels       %zu matrices (%s), %.1f MB in %s: a load maps them instead of packing%s\n"
              "  time         %.1f s, %d threads\n",
              o.model_dir.c_str(), written.matrices, quantized ? "the stored formats" : "bf16, as --weights auto packs",
              written.bytes / 1e6, path.c_str(), o.out.empty() ? "" : " (give it as --panels)", seconds, num_threads());
}

void setup_pack(CLI::App& app) {
  auto o = std::make_shared<PackOptions>();
  auto* cmd = app.add_subcommand("pack", "Write panels.moex for a checkpoint (its matrices packed), so it loads with no packing");
  cmd->add_option("--model", o->model_dir, "Hugging Face model folder: bf16/f16/f32 (the bf16 panels --weights auto "
                  "packs) or quantized (compressed-tensors, fp8 blocks: its stored formats)")
      ->required();
  cmd->add_option("--out", o->out, "Write the panels to this file instead of beside the checkpoint (a read-only "
                  "model folder); load with --panels PATH");
  cmd->add_flag("--force", o->force, "Replace an existing panels file");
  add_quiet_flag(cmd);
  o->threads.add_to(cmd);
  cmd->callback([o] { run_pack(*o); });
}
MOEX_REGISTER_COMMAND(setup_pack);

}  // namespace
}  // namespace moex::tools
