// Roofline probes (tools/lib: only commands and tests call them): how fast this machine streams bytes from DRAM into registers, with the same
// threads and loads the matmul uses. Decode throughput is judged against it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace moex::kernels {

// Seconds by this thread's CPU clock (cpu_clock: what other processes on the core do not add to) or the
// steady clock; the probes' and the kernel benchmark's one timer.
double now_seconds(bool cpu_clock);

// Reads every byte of data[0, bytes) once (all threads, each a contiguous share) and returns a checksum so the
// reads stay. prefetch_lead > 0: each thread also prefetches (into L2) that many bytes ahead of its loads, as the
// packed kernels do (x86/prefetch.h); some machines stream faster so, some without.
float stream_read(const void* data, size_t bytes, int64_t prefetch_lead = 0);

// The read probe: bytes/s of stream_read over a buffer of `bytes` on huge pages (as the packed weights are: on 4 KB
// pages a 1 GB stream also walks ~260,000 page-table entries), `repeats` passes after a warm-up for each way of
// reading, each pass timed in kReadSegments consecutive segments (each segment's bytes were last read a whole
// buffer ago, so no cache above the buffer's size holds them); the best segment is the probe. Best, not median,
// for the reason best_peaks gives.
struct ReadProbe {
  double bytes_per_s = 0;        // the best of the methods below
  double plain_bytes_per_s = 0;  // loads alone (hardware prefetchers)
  double prefetch_bytes_per_s = 0;  // loads plus a software prefetch kStreamLead ahead
  const char* method = "loads";  // the best one's name
  size_t bytes = 0;              // the buffer
  size_t huge_page_bytes = 0;    // of it on 2 MB pages (what the kernel granted the advice)
};
// Bytes of [data, data + bytes) that sit on transparent huge pages (AnonHugePages of the mappings that overlap it,
// /proc/self/smaps; 0 where that cannot be read).
size_t huge_page_bytes(const void* data, size_t bytes);
constexpr int kReadSegments = 8;
ReadProbe read_probe(size_t bytes, int repeats, bool cpu_clock);

// The replay probe (docs/kernels.md, "Probes"): the byte ranges a sequence of forward steps reads, in the
// order the step reads them, streamed with no arithmetic and no barrier. Its time is the least any kernel
// could take for exactly those bytes in that cache state (a step that re-reads what the previous one read
// finds it where the kernels would), which a plain DRAM stream over a large buffer is not.
struct ByteRange {
  const void* data = nullptr;
  size_t bytes = 0;
};
using StepReads = std::vector<ByteRange>;  // one step's reads, in order
struct ReplayResult {
  float checksum = 0;  // the sum of the floats read (a partial float at a range's end: its bytes as loaded)
  size_t bytes = 0;    // bytes the loops read, all threads
};
// How the threads share a step's bytes. kEachRange: every thread reads its contiguous share (whole 64-byte
// lines) of every range, in order, as a kernel that splits each matrix's rows does. kEachStep: the step's ranges
// laid end to end are cut into one contiguous share per thread (at 64-byte lines of that sequence), as a kernel
// whose threads take whole matrices or experts does; a thread streams fewer, longer runs.
enum class ReplaySplit { kEachRange, kEachStep };
// Reads every byte of every step once, in order, the threads sharing each step as `split` says.
ReplayResult stream_read_steps(const std::vector<StepReads>& steps, ReplaySplit split = ReplaySplit::kEachRange);

// Compute roofline probes: the dot-product instructions the packed kernels use, back to back on registers
// in every thread. `per_second` is 0 when the CPU lacks the instruction. `checksum` is what the
// accumulators summed to, which a test checks against the instruction count the rate is computed from.
struct PeakResult {
  double per_second = 0;  // FLOP/s (bf16: 2 per product) or OP/s (int8: 2 per product)
  double checksum = 0;
  int threads = 0;
  int64_t instructions = 0;  // all threads
};
// cpu_clock: each thread's rate over its own CPU time, summed (what the cores do while they run, for a
// machine that other processes load); otherwise all instructions over the wall time.
PeakResult dot_peak_bf16(int64_t iterations_per_thread = 1 << 22, bool cpu_clock = false);  // vdpbf16ps: 64 FLOP each
PeakResult dot_peak_vnni(int64_t iterations_per_thread = 1 << 22, bool cpu_clock = false);  // vpdpbusd: 128 OP each
// vpmaddubsw on ymm (32 u8 x s8 products into int16 pairs: 64 OP each), summed in int16 as the AVX2 W4A8 kernel
// sums: the int8 peak of a CPU with AVX2 but no VNNI (0 without AVX2 kernels)
PeakResult dot_peak_maddubs(int64_t iterations_per_thread = 1 << 22, bool cpu_clock = false);
// vfmadd231ps on zmm (32 FLOP each), or on ymm (16) on a CPU with AVX2 + FMA only
PeakResult fma_peak_f32(int64_t iterations_per_thread = 1 << 22, bool cpu_clock = false);
// AMX tiles (0 without AMX, or where Linux refuses the tile state): tdpbf16ps, 16 x 16 x 32 bf16 products
// (16,384 FLOP) each, and tdpbusd, 16 x 16 x 64 u8 x s8 products (32,768 OP) each. One instruction does what
// ~256 vdpbf16ps do, so the default iteration count is 16x smaller than the vector probes'.
PeakResult dot_peak_amx_bf16(int64_t iterations_per_thread = 1 << 18, bool cpu_clock = false);
PeakResult dot_peak_amx_int8(int64_t iterations_per_thread = 1 << 18, bool cpu_clock = false);

// Every probe above, each the best of `trials` short runs (~2 ms: within one scheduler time slice even on a
// machine loaded several times over, so some runs have both cores to themselves), alternated. The
// best, not the median: a machine shared with other processes slows some runs, never speeds one up, and the
// probe must bound what a kernel can do while it has the cores (a median under load let a kernel measured in a
// quieter moment reach 120% of it).
struct PeakSet {
  PeakResult bf16, vnni, maddubs, fma, amx_bf16, amx_int8;
};
PeakSet best_peaks(bool cpu_clock = false, int trials = 48);

// The core clock, Hz: a chain of dependent integer adds (one cycle each on every x86 core since the P6) run in
// every thread at once, each thread's adds over its own CPU time, the median thread. What a probe's instruction
// rate is divided by to give instructions per cycle.
double core_clock_hz(int64_t adds_per_thread = int64_t{1} << 27);

// What this CPU class is documented to issue per core per cycle, for the instructions the probes time; 0 where
// not known. Whether two of the probe's threads share a core (SMT siblings) is not knowable from inside a VM, so
// the benchmarks print the measured instructions per cycle per thread beside these, and the reader compares.
struct CpuClassRates {
  const char* name = "unknown x86";
  double fma_zmm = 0, bf16_zmm = 0, vnni_zmm = 0, amx_tile = 0;  // instructions per core per cycle
  const char* source = "";
};
CpuClassRates cpu_class_rates();
// family / model from CPUID leaf 1 (extended fields folded in), 0 off x86
struct CpuId {
  int family = 0, model = 0;
  bool amd = false, intel = false;
};
CpuId cpu_id();

namespace x86 {
// Independent accumulators per thread: above latency x issue width of every dot-product instruction probed (Zen 4:
// vdpbf16ps 6 cycles x 1 zmm per cycle; Zen 5 and Intel's two 512-bit ports: 4-6 x 2 = 8-12), twice over so a
// thread alone, or one that SMT pairs with an idle sibling, still fills the pipes. 24 of the 32 zmm registers.
constexpr int kPeakChains = 24;
// The chains as 24 named variables (X(0) ... X(23)), not an array: GCC 12 kept an array of accumulators in memory,
// interchanged the loops and ran each chain's instructions back to back through a store and a load, so the probes
// measured that loop (0.85 vdpbf16ps per cycle on Zen 4, which the bf16 prefill beat) rather than the instruction.
// Each chain's zero passes through an empty asm, so the compiler cannot prove the chains equal and merge them
// into one (it did, with 24 plain zeros).
#define MOEX_PEAK_CHAINS(X) \
  X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
float stream_read_avx512(const void* data, size_t bytes, int64_t prefetch_lead = 0);
// Every byte of data[0, bytes) exactly (a masked load for the last partial line); adds the bytes read to *read.
float stream_read_exact_avx512(const void* data, size_t bytes, size_t* read);
double dpbf16_loop_avx512bf16(int64_t iterations, uint16_t one_bf16);  // kPeakChains x iterations instructions
double dpbusd_loop_avx512vnni(int64_t iterations, uint8_t one);
double fma_loop_avx512(int64_t iterations, float one);
// x86/probe_amx.cc: kAmxPeakRounds rounds of 4 tile instructions per iteration (kPeakChains in all).
constexpr int kAmxPeakRounds = kPeakChains / 4;
double tdpbf16_loop_amx(int64_t iterations, uint16_t one_bf16);
double tdpbusd_loop_amx(int64_t iterations, uint8_t one);
// x86/probe_avx2.cc: the same on CPUs with AVX2 + FMA but no AVX-512 (use_avx2_kernels()).
float stream_read_avx2(const void* data, size_t bytes, int64_t prefetch_lead = 0);
float stream_read_exact_avx2(const void* data, size_t bytes, size_t* read);
double fma_loop_avx2(int64_t iterations, float one);  // 16 FLOP per instruction
double maddubs_loop_avx2(int64_t iterations, uint8_t one);  // kPeakChains x iterations vpmaddubsw
}  // namespace x86

}  // namespace moex::kernels
