// `moex bench kernels`: the packed-format kernels on one expert's shapes (a preset's or given), against the
// read-bandwidth and dot-product probes measured in the same run. The work is kernels::bench_kernels.
#include <cstdio>
#include <memory>
#include <sstream>

#include <nlohmann/json.hpp>

#include "moex/base/threads.h"
#include "tools/lib/kernel_bench.h"
#include "tools/lib/synthetic.h"
#include "tools/moex/bench.h"
#include "tools/moex/flags.h"

namespace moex::tools {
namespace {

struct KernelsFlags {
  std::string preset = "mini";
  int hidden = 0, intermediate = 0;
  int experts = 0, top_k = 0;  // moe rows; 0: the preset's
  // The defaults are kernels::KernelBenchOptions'.
  std::vector<int64_t> tokens = ::moex::kernels::KernelBenchOptions{}.tokens;
  std::vector<std::string> formats = ::moex::kernels::KernelBenchOptions{}.formats;
  std::vector<std::string> kernels = ::moex::kernels::KernelBenchOptions{}.kernels;
  int repeats = 5;
  size_t roofline_mb = 1024;
  size_t cycle_mb = ::moex::kernels::KernelBenchOptions{}.cycle_mb;
  ThreadsFlags threads;
  bool cpu_clock = false;
  bool json = false;
};

void run_kernels(const KernelsFlags& f) {
  f.threads.apply();
  const ModelConfig preset = synthetic_preset(f.preset);
  kernels::KernelBenchOptions o;
  o.hidden = f.hidden > 0 ? f.hidden : preset.hidden_size;
  o.intermediate = f.intermediate > 0 ? f.intermediate : preset.intermediate_size;
  o.experts = f.experts > 0 ? f.experts : preset.num_local_experts;
  o.top_k = f.top_k > 0 ? f.top_k : preset.num_experts_per_tok;
  o.tokens = f.tokens;
  o.formats = f.formats;
  o.kernels = f.kernels;
  o.repeats = f.repeats;
  o.roofline_mb = f.roofline_mb;
  o.cycle_mb = f.cycle_mb;
  o.cpu_clock = f.cpu_clock;
  const kernels::KernelBenchReport r = kernels::bench_kernels(o);
  if (f.json) {
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& row : r.rows)
      rows.push_back({{"kernel", row.kernel}, {"format", row.format}, {"isa", row.isa}, {"tokens", row.tokens},
                      {"rows", row.rows}, {"cols", row.cols}, {"us", row.seconds * 1e6}, {"gb_per_s", row.gb_per_s},
                      {"gflops", row.gflops}, {"read_gb_per_s", row.read_bytes_per_s / 1e9},
                      {"pct_read_roofline", row.pct_read_roofline}, {"pct_dram", row.pct_dram},
                      {"pct_compute_peak", row.pct_compute_peak}, {"pct_roofline", row.pct_roofline}});
    std::printf("%s\n", nlohmann::json{{"hidden", o.hidden}, {"intermediate", o.intermediate}, {"threads", r.threads},
                                       {"read_gb_per_s", r.read_bytes_per_s / 1e9},
                                       {"read_method", r.read.method},
                                       {"read_plain_gb_per_s", r.read.plain_bytes_per_s / 1e9},
                                       {"read_prefetch_gb_per_s", r.read.prefetch_bytes_per_s / 1e9},
                                       {"clock_ghz", r.clock_hz / 1e9},
                                       {"cpu_class", kernels::cpu_class_rates().name},
                                       {"cpu_family", kernels::cpu_id().family},
                                       {"cpu_model", kernels::cpu_id().model},
                                       {"bf16_peak_gflops", r.bf16_peak.per_second / 1e9},
                                       {"vnni_peak_gops", r.vnni_peak.per_second / 1e9},
                                       {"maddubs_peak_gops", r.maddubs_peak.per_second / 1e9},
                                       {"fma_peak_gflops", r.fma_peak.per_second / 1e9},
                                       {"amx_bf16_peak_gflops", r.amx_bf16_peak.per_second / 1e9},
                                       {"amx_int8_peak_gops", r.amx_int8_peak.per_second / 1e9}, {"results", rows}}
                            .dump()
                            .c_str());
    return;
  }
  std::printf("kernels: expert hidden %lld, intermediate %lld (moe: %d experts top-%d), %d threads; probes: read %.1f GB/s, "
              "vdpbf16ps %.0f GFLOPS, vpdpbusd %.0f GOPS, vpmaddubsw %.0f GOPS, vfmadd231ps %.0f GFLOPS, "
              "AMX tdpbf16ps %.0f GFLOPS, tdpbusd %.0f GOPS\n",
              static_cast<long long>(o.hidden), static_cast<long long>(o.intermediate), o.experts, o.top_k, r.threads,
              r.read_bytes_per_s / 1e9, r.bf16_peak.per_second / 1e9, r.vnni_peak.per_second / 1e9,
              r.maddubs_peak.per_second / 1e9, r.fma_peak.per_second / 1e9, r.amx_bf16_peak.per_second / 1e9,
              r.amx_int8_peak.per_second / 1e9);
  std::printf("%s", kernels::describe_probes(r.read, r.clock_hz, r.bf16_peak, r.vnni_peak, r.fma_peak, r.amx_bf16_peak).c_str());
  std::printf("%-8s %-15s %-11s %5s %13s %10s %8s %8s %7s %7s %7s %7s %7s\n", "kernel", "format", "isa", "T", "matrix",
              "us", "GB/s", "GFLOPS", "probe", "%read", "%dram", "%peak", "%roof");
  for (const auto& row : r.rows) {
    char shape[32];
    std::snprintf(shape, sizeof shape, "%lldx%lld", static_cast<long long>(row.rows), static_cast<long long>(row.cols));
    char peak[16] = "-";
    if (row.pct_compute_peak > 0) std::snprintf(peak, sizeof peak, "%.1f", row.pct_compute_peak);
    std::printf("%-8s %-15s %-11s %5lld %13s %10.1f %8.1f %8.1f %7.1f %7.1f %7.1f %7s %7.1f%s\n", row.kernel.c_str(),
                row.format.c_str(), row.isa.c_str(), static_cast<long long>(row.tokens), shape, row.seconds * 1e6,
                row.gb_per_s, row.gflops, row.read_bytes_per_s / 1e9, row.pct_read_roofline, row.pct_dram, peak,
                row.pct_roofline, row.pct_roofline > 100.0 ? " PROBE TOO LOW" : "");
  }
  std::printf("probe: GB/s of the row's read probe, the replay of exactly the bytes its calls read, run after each of "
              "its samples (median); %%read: weight bytes per second over it (decode's roofline); %%dram: over the "
              "run's DRAM probe (read, above, once before the rows); %%peak: FLOP/s over the "
              "probe of the kernel's dot-product instruction (isa avx512bf16: vdpbf16ps, avx512vnni: vpdpbusd (int8: half of "
              "it, vpdpwssd's two products per lane at vpdpbusd's rate), amx: "
              "tdpbf16ps (bf16) or tdpbusd (int8-w8a8), avx2 "
              "int8-w8a8 / int4-w4a8: vpmaddubsw, other avx512 and avx2: vfmadd231ps);\n"
              "%%roof: the batched roofline max(bytes / the row's probe, FLOPs / peak) over the time taken.\n");
  std::printf("%s", kernels::rows_over_probe(r).c_str());
}

void setup_kernels_bench(CLI::App& bench) {
  auto flags = std::make_shared<KernelsFlags>();
  auto* cmd = bench.add_subcommand("kernels", "Packed-format expert kernels against the read and dot-product probes");
  cmd->add_option("--preset", flags->preset, "Expert shapes of a gen-model preset (mini, mixtral-8x7b, ...)")->capture_default_str();
  cmd->add_option("--hidden", flags->hidden, "Override the hidden size");
  cmd->add_option("--intermediate", flags->intermediate, "Override the intermediate size");
  cmd->add_option("--experts", flags->experts, "moe rows: override the preset's experts per layer")->check(CLI::Range(1, 1024));
  cmd->add_option("--top-k", flags->top_k, "moe rows: override the preset's experts per token")->check(CLI::Range(1, 1024));
  add_list_flag(cmd, "--tokens", flags->tokens, "Tokens per call")->check(whole_number_in(1, INT32_MAX));
  add_list_flag(cmd, "--formats", flags->formats, "Weight formats");
  add_list_flag(cmd, "--kernels", flags->kernels, "w1, gate_up, down; moe, moe_unfused: a layer's experts (the preset's count and top-k, or --experts / --top-k), fused_experts against the expert-by-expert calls; attention, attention_portable: causal paged attention of a T-token prompt (bf16 KV), this CPU's vector tile against the portable one; attention_decode, attention_decode_portable: 16 sequences, one query each over a T-position context; dense: the as-stored bf16 matmul (attention projections, lm_head) on w1's shape, f32 activations");
  cmd->add_option("--repeats", flags->repeats, "Samples per cell (median reported)")->capture_default_str();
  cmd->add_option("--roofline-mb", flags->roofline_mb, "Read-probe buffer size")->capture_default_str();
  cmd->add_option("--cycle-mb", flags->cycle_mb,
                  "MB of weight copies the calls cycle through: above the L3 every call reads from DRAM; below the L2 "
                  "(e.g. 1) the kernel's in-cache speed")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{65536}));
  flags->threads.add_to(cmd);
  cmd->add_flag("--cpu-clock", flags->cpu_clock,
                "Time on the thread's CPU clock (with --threads 1, when other processes load the machine)");
  cmd->add_flag("--json", flags->json, "Machine-readable output");
  cmd->callback([flags] { run_kernels(*flags); });
}
MOEX_REGISTER_BENCH(setup_kernels_bench);

}  // namespace
}  // namespace moex::tools
