// `moex pack`: writes panels.moex beside a quantized checkpoint that did not come from `moex quantize` (an
// llm-compressor checkpoint, a DeepSeek-style FP8 one), so that it too loads with no packing at start-up
// (model/panels_file.h; docs/kernels.md, "panels.moex").
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "moex/base/error.h"
#include "moex/base/threads.h"
#include "moex/model/panels_file.h"
#include "tools/lib/panels_writer.h"
#include "tools/moex/command.h"
#include "tools/moex/flags.h"

namespace moex::tools {
namespace {

struct PackOptions {
  std::string model_dir;
  bool force = false;
  ThreadsFlags threads;
};

void run_pack(const PackOptions& o) {
  namespace fs = std::filesystem;
  const auto start = std::chrono::steady_clock::now();
  o.threads.apply();
  const fs::path path = fs::path(o.model_dir) / kPanelsFileName;
  std::error_code ec;
  MOEX_CHECK_INPUT(fs::is_directory(o.model_dir, ec), "--model ", o.model_dir, " is not a model folder");
  MOEX_CHECK_INPUT(o.force || !fs::exists(path, ec), path.string(),
                   " exists: pass --force to replace it (it is written anew, then renamed over the old one)");
  const PanelsWritten written = write_panels(o.model_dir);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("moex pack: %s\n  panels       %zu matrices, %.1f MB in %s: a load maps them instead of packing\n"
              "  time         %.1f s, %d threads\n",
              o.model_dir.c_str(), written.matrices, written.bytes / 1e6, kPanelsFileName, seconds, num_threads());
}

void setup_pack(CLI::App& app) {
  auto o = std::make_shared<PackOptions>();
  auto* cmd = app.add_subcommand("pack", "Write panels.moex beside a quantized checkpoint, so it loads with no packing");
  cmd->add_option("--model", o->model_dir, "Quantized Hugging Face model folder (compressed-tensors or fp8 blocks)")
      ->required();
  cmd->add_flag("--force", o->force, "Replace an existing panels.moex");
  add_quiet_flag(cmd);
  o->threads.add_to(cmd);
  cmd->callback([o] { run_pack(*o); });
}
MOEX_REGISTER_COMMAND(setup_pack);

}  // namespace
}  // namespace moex::tools
