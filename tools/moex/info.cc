// `moex info`: what this machine offers MoEX (ISA, threads, which kernels run) and, under mpirun, which
// ranks share a host. Rank 0 prints for the job; the others print nothing (the same lines once).
#include <cstdio>
#include <string>

#include "moex/base/cpu.h"
#include "moex/base/threads.h"
#include "moex/comm/communicator.h"
#include "moex/kernels/formats.h"
#include "moex/kernels/packed.h"
#include "tools/moex/command.h"

namespace moex::tools {
namespace {

void setup_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Print CPU features, thread count and the kernels in use");
  cmd->callback([] {
    set_num_threads(0);  // reports a bad MOEX_THREADS or MOEX_ISA rather than printing what replaced it
    comm::Communicator& world = comm::world();
    if (world.rank() != 0) return;
    std::printf("cpu features: %s\n", cpu_features().str().c_str());
    std::printf("kernels:      %s\n", use_x86_kernels()    ? "x86 (AVX-512)"
                                     : use_avx2_kernels() ? "x86 (AVX2 + FMA for the packed matmuls below; the rest scalar)"
                                                          : "ref (scalar)");
    std::printf("threads:      %d\n", num_threads());
    // What each --weights format runs on here (kernels::kernel_isa: never an ISA the CPU lacks), as few/many
    // where a call of many rows (kernels::isa_for_rows at 512) runs elsewhere than one of a single row; --weights
    // as-stored runs kernels/matmul.h's f32 loop (AVX-512 FMA, or scalar).
    using kernels::WeightFormat;
    std::printf("packed kernels (--weights; few/many rows):");
    for (const kernels::FormatTraits& t : kernels::all_formats()) {  // the format table (kernels/formats.h)
      const WeightFormat f = t.format;
      const kernels::Isa isa = kernels::kernel_isa(f), few = kernels::isa_for_rows(f, isa, 1),
                         many = kernels::isa_for_rows(f, isa, 512);
      std::printf(" %s=%s", std::string(kernels::weight_format_name(f)).c_str(), std::string(kernels::isa_name(few)).c_str());
      if (many != few) std::printf("/%s", std::string(kernels::isa_name(many)).c_str());
    }
    std::printf("\n");
    // What a command runs without --weights / --dense-weights (tools/moex/model_flags.h, weight_path).
    std::printf("default path: --weights auto: a bf16/f16/f32 checkpoint runs bf16 (experts + dense, bf16 activations, "
                "%s); a quantized one its own format; --exact: as stored with f32 activations (the reference path)\n",
                std::string(kernels::isa_name(kernels::kernel_isa(WeightFormat::kBF16))).c_str());
    const comm::Topology& topology = world.topology();
    std::printf("ranks:        %d on %d host%s\n", topology.ranks(), topology.hosts(), topology.hosts() > 1 ? "s" : "");
    for (const std::string& line : comm::describe_topology(topology)) std::printf("  %s\n", line.c_str());
  });
}
MOEX_REGISTER_COMMAND(setup_info);

}  // namespace
}  // namespace moex::tools
