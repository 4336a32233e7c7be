// Kernel microbenchmark: each packed format's matmul, fused gate/up and routed down projection on an
// expert's shapes, against the probes measured in the same run (per row, the replay of the bytes its calls
// read, timed beside its samples; the vdpbf16ps / vpdpbusd / AMX tile peaks for its FLOPs). Callable from a command (`moex bench kernels`) or a test.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moex/kernels/packed.h"
#include "tools/lib/probes.h"

namespace moex::kernels {

struct KernelBenchOptions {
  int64_t hidden = 1024, intermediate = 3584;  // one expert: w1, w3 [intermediate, hidden], w2 [hidden, intermediate]
  std::vector<int64_t> tokens = {1, 64, 512};  // tokens routed to the expert per call
  std::vector<std::string> formats = {"bf16", "int8", "int8-w8a8", "int4-g128", "int4-g128-asym", "int4-w4a8-g128", "fp8-e4m3"};
  std::vector<std::string> kernels = {"w1", "gate_up", "down"};
  int experts = 8, top_k = 2;                 // moe, moe_unfused: the layer's experts and experts per token
  int repeats = 5;
  double sample_ms = 20;          // calls per sample: enough to last this long
  size_t roofline_mb = 1024;      // read-bandwidth probe buffer
  size_t cycle_mb = 256;          // copies of the weights cycled so every call reads from DRAM (above the L3's size)
  bool cpu_clock = false;         // time on the thread's CPU clock (one thread only): for a machine others load
};

struct KernelBenchRow {
  std::string kernel, format, isa;
  int64_t tokens = 0, rows = 0, cols = 0;  // the matrix [rows, cols] (gate_up: each of w1 and w3)
  double seconds = 0;                       // per call, median of the samples
  double weight_bytes = 0, flops = 0;       // per call
  double gb_per_s = 0, gflops = 0;
  // The row's own read probe: bytes/s of the replay of exactly the bytes its calls read (the same copies, in
  // the kernel's order: stream_read_steps), run right after each timed sample, median (bench_kernels).
  double read_bytes_per_s = 0;
  double pct_read_roofline = 0;             // weight bytes / s over the row's read probe (read_bytes_per_s)
  double pct_dram = 0;                      // weight bytes / s over the run's DRAM probe (report.read_bytes_per_s)
  double pct_compute_peak = 0;              // FLOP/s over the format's dot-product probe (0: none measured)
  // The batched roofline: max(bytes / the row's read probe, FLOPs / dot-product probe) over the time taken
  // (memory alone when the kernel's instruction has no probe).
  double pct_roofline = 0;
};

struct KernelBenchReport {
  double read_bytes_per_s = 0;  // the DRAM probe (read_probe over a buffer of its own, once before the rows)
  ReadProbe read;
  double clock_hz = 0;  // core_clock_hz() in the same run
  PeakResult bf16_peak, vnni_peak, maddubs_peak, fma_peak, amx_bf16_peak, amx_int8_peak;
  int threads = 0;
  std::vector<KernelBenchRow> rows;
};

struct FormatSpec {
  WeightFormat format = WeightFormat::kBF16;
  int64_t group = 0;  // int4 only
  bool symmetric = true;
};
// Parses "bf16", "int8", "int8-w8a8", "int4-g32|g64|g128[-asym]", "int4-w4a8-g32|g64|g128[-asym]", "fp8-e4m3";
// throws an input error otherwise.
FormatSpec parse_format_spec(const std::string& name);
KernelBenchReport bench_kernels(const KernelBenchOptions& options);
// Read bandwidth (bytes/s): read_probe(bytes, repeats, cpu_clock)'s best method.
double read_bandwidth(size_t bytes, int repeats, bool cpu_clock);

// What the probes assume, for a benchmark's header: the CPU class (family / model), the clock measured in the same
// run, the read probe's methods, and each dot-product probe's instructions per cycle per thread beside the rate the
// class is documented to issue per core (cpu_class_rates()). Several lines, each ending in a newline.
std::string describe_probes(const ReadProbe& read, double clock_hz, const PeakResult& bf16, const PeakResult& vnni,
                            const PeakResult& fma, const PeakResult& amx_bf16);
// The rows over 100% of a probe, one line each ("" when none): a kernel faster than its probe shows the probe
// was not the limit, so the percentages of that run are not to be trusted.
std::string rows_over_probe(const KernelBenchReport& report);

}  // namespace moex::kernels
