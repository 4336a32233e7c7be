// `moex info`: what this machine offers MoEX (ISA, threads, which kernels run).
#include <cstdio>

#include "moex/base/cpu.h"
#include "moex/base/threads.h"
#include "tools/moex/command.h"

namespace moex::tools {
namespace {

void setup_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Print CPU features, thread count and the kernels in use");
  cmd->callback([] {
    set_num_threads(0);  // reports a bad MOEX_THREADS or MOEX_ISA rather than printing what replaced it
    std::printf("cpu features: %s\n", cpu_features().str().c_str());
    std::printf("kernels:      %s\n", use_x86_kernels() ? "x86 (AVX-512)" : "ref (scalar)");
    std::printf("threads:      %d\n", num_threads());
  });
}
MOEX_REGISTER_COMMAND(setup_info);

}  // namespace
}  // namespace moex::tools
