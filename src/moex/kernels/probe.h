// Memory roofline probe: how fast this machine streams bytes from DRAM into registers, with the same
// threads and loads the matmul uses. Decode throughput is judged against it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace moex::kernels {

// Reads every byte of data[0, bytes) once (all threads) and returns a checksum so the reads stay.
float stream_read(const void* data, size_t bytes);

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
// Every thread reads its contiguous share (whole 64-byte lines) of every range of every step, in order.
ReplayResult stream_read_steps(const std::vector<StepReads>& steps);

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

namespace x86 {
constexpr int kPeakChains = 12;  // independent accumulators per thread
float stream_read_avx512(const void* data, size_t bytes);
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
float stream_read_avx2(const void* data, size_t bytes);
float stream_read_exact_avx2(const void* data, size_t bytes, size_t* read);
double fma_loop_avx2(int64_t iterations, float one);  // 16 FLOP per instruction
double maddubs_loop_avx2(int64_t iterations, uint8_t one);  // kPeakChains x iterations vpmaddubsw
}  // namespace x86

}  // namespace moex::kernels
