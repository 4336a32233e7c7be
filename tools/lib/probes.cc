#include "tools/lib/probes.h"

#include <sys/mman.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "moex/base/cpu.h"
#include "moex/base/error.h"
#include "moex/base/system_memory.h"
#include "moex/base/threads.h"
#include "moex/kernels/x86/prefetch.h"

namespace moex::kernels {

float stream_read(const void* data, size_t bytes, int64_t prefetch_lead) {
  const auto* base = static_cast<const uint8_t*>(data);
  constexpr int64_t kBlock = 1 << 16;
  const int64_t blocks = static_cast<int64_t>(bytes / kBlock);
  float partial[256] = {};
  parallel_for(blocks, 1, [&](int64_t begin, int64_t end) {
    float sum = 0.0f;
    if (use_x86_kernels()) {
      sum = x86::stream_read_avx512(base + begin * kBlock, static_cast<size_t>(end - begin) * kBlock, prefetch_lead);
    } else if (use_avx2_kernels()) {
      sum = x86::stream_read_avx2(base + begin * kBlock, static_cast<size_t>(end - begin) * kBlock, prefetch_lead);
    } else {
      for (int64_t i = begin * kBlock; i < end * kBlock; i += 64) {
        float v;
        std::memcpy(&v, base + i, sizeof v);
        sum += v;
      }
    }
    partial[omp_get_thread_num() % 256] += sum;
  });
  float total = 0.0f;
  for (float p : partial) total += p;
  return total;
}

ReplayResult stream_read_steps(const std::vector<StepReads>& steps, ReplaySplit split) {
  const int threads = num_threads();
  float sums[256] = {};
  size_t read[256] = {};
  // One parallel region for all steps and no barrier between ranges: a kernel must also wait for its inputs,
  // so this is a lower bound on the time of a split of the same bytes like this one.
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    float sum = 0.0f;
    size_t n = 0;
    for (const StepReads& step : steps) {
      // kEachStep: this thread's share [lo, hi) of the step's bytes laid end to end; `at` is a range's start there.
      size_t lo = 0, hi = 0, at = 0;
      if (split == ReplaySplit::kEachStep) {
        size_t total = 0;
        for (const ByteRange& r : step) total += r.bytes;
        const size_t lines = (total + 63) / 64, per = (lines + threads - 1) / threads;
        lo = std::min(total, t * per * 64), hi = std::min(total, lo + per * 64);
      }
      for (const ByteRange& r : step) {
        size_t begin, end;
        if (split == ReplaySplit::kEachStep) {
          begin = std::clamp(lo, at, at + r.bytes) - at, end = std::clamp(hi, at, at + r.bytes) - at;
          at += r.bytes;
        } else {
          const size_t lines = (r.bytes + 63) / 64, per = (lines + threads - 1) / threads;
          begin = std::min(r.bytes, t * per * 64), end = std::min(r.bytes, begin + per * 64);
        }
        if (begin == end) continue;
        const auto* p = static_cast<const uint8_t*>(r.data) + begin;
        if (use_x86_kernels()) {
          sum += x86::stream_read_exact_avx512(p, end - begin, &n);
        } else if (use_avx2_kernels()) {
          sum += x86::stream_read_exact_avx2(p, end - begin, &n);
        } else {  // one float per 4 bytes, then the tail's bytes, as the masked load would see them
          size_t i = 0;
          for (; i + 4 <= end - begin; i += 4) {
            float v;
            std::memcpy(&v, p + i, sizeof v);
            sum += v;
          }
          if (i < end - begin) {
            uint8_t tail[4] = {};
            std::memcpy(tail, p + i, end - begin - i);
            float v;
            std::memcpy(&v, tail, sizeof v);
            sum += v;
          }
          n += end - begin;
        }
      }
    }
    sums[t % 256] = sum;
    read[t % 256] = n;
  }
  ReplayResult result;
  for (int t = 0; t < 256; ++t) {
    result.checksum += sums[t];
    result.bytes += read[t];
  }
  return result;
}

namespace {

double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

}  // namespace

double now_seconds(bool cpu_clock) {
  if (cpu_clock) return thread_cpu_seconds();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

size_t huge_page_bytes(const void* data, size_t bytes) {
  FILE* f = std::fopen("/proc/self/smaps", "r");
  if (!f) return 0;
  const auto begin = reinterpret_cast<uintptr_t>(data), end = begin + bytes;
  size_t total = 0;
  bool inside = false;  // the lines after a mapping's header belong to it
  char line[512];
  while (std::fgets(line, sizeof line, f)) {
    unsigned long lo = 0, hi = 0;
    char dash = 0;
    if (std::sscanf(line, "%lx%c%lx ", &lo, &dash, &hi) == 3 && dash == '-') {
      inside = lo < end && hi > begin;
      continue;
    }
    unsigned long kb = 0;
    if (inside && std::sscanf(line, "AnonHugePages: %lu kB", &kb) == 1) total += static_cast<size_t>(kb) << 10;
  }
  std::fclose(f);
  return std::min(total, bytes);
}

ReadProbe read_probe(size_t bytes, int repeats, bool cpu_clock) {
  // 2 MB aligned, so the whole buffer can sit on huge pages
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t mapped = bytes + kHuge;
  void* map = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  MOEX_CHECK(map != MAP_FAILED, "cannot map ", bytes, " bytes for the read probe");
  auto* buffer = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(map) + kHuge - 1) & ~(kHuge - 1));
  advise_huge_pages(buffer, bytes);
  std::memset(buffer, 1, bytes);
  ReadProbe p;
  p.huge_page_bytes = huge_page_bytes(buffer, bytes);
  p.bytes = bytes;
  volatile float sink = 0.0f;
  // whole stream_read blocks (a buffer under kReadSegments of them: one segment, all of it)
  size_t segment = bytes / kReadSegments / 65536 * 65536;
  const int segments = segment > 0 ? kReadSegments : 1;
  if (segment == 0) segment = bytes;
  const auto best_rate = [&](int64_t lead) {
    sink = sink + stream_read(buffer, bytes, lead);  // warm-up
    double best = 0;
    for (int r = 0; r < std::max(repeats, 1); ++r)
      for (int s = 0; s < segments; ++s) {
        const double t0 = now_seconds(cpu_clock);
        sink = sink + stream_read(buffer + s * segment, segment, lead);
        best = std::max(best, static_cast<double>(segment) / (now_seconds(cpu_clock) - t0));
      }
    return best;
  };
  // Alternated, so a change in the machine's load between them moves both alike.
  for (int round = 0; round < 2; ++round) {
    p.plain_bytes_per_s = std::max(p.plain_bytes_per_s, best_rate(0));
    p.prefetch_bytes_per_s = std::max(p.prefetch_bytes_per_s, best_rate(x86::kStreamLead));
  }
  p.bytes_per_s = std::max(p.plain_bytes_per_s, p.prefetch_bytes_per_s);
  p.method = p.prefetch_bytes_per_s > p.plain_bytes_per_s ? "loads + prefetch" : "loads";
  ::munmap(map, mapped);
  return p;
}

double core_clock_hz(int64_t adds_per_thread) {
#if defined(__x86_64__)
  const int threads = num_threads();
  std::vector<double> hz(threads);
  volatile uint64_t sink = 0;
#pragma omp parallel num_threads(threads)
  {
    uint64_t x = 0;
    const double t0 = thread_cpu_seconds();
    for (int64_t i = 0; i < adds_per_thread; i += 8)  // 8 adds, each waiting for the last; the loop's own work
      asm volatile(                                     // runs beside them on the other ALUs
          "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
          "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0"
          : "+r"(x));
    hz[omp_get_thread_num()] = static_cast<double>(adds_per_thread) / (thread_cpu_seconds() - t0);
    sink = sink + x;
  }
  std::sort(hz.begin(), hz.end());
  return hz[hz.size() / 2];
#else
  return 0;
#endif
}

CpuId cpu_id() {
  CpuId id;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return id;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  id.amd = std::strcmp(vendor, "AuthenticAMD") == 0;
  id.intel = std::strcmp(vendor, "GenuineIntel") == 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return id;
  const int base_family = (a >> 8) & 0xf, base_model = (a >> 4) & 0xf;
  id.family = base_family == 0xf ? base_family + ((a >> 20) & 0xff) : base_family;
  id.model = base_family == 0xf || base_family == 0x6 ? base_model + (((a >> 16) & 0xf) << 4) : base_model;
#endif
  return id;
}

CpuClassRates cpu_class_rates() {
  const CpuId id = cpu_id();
  const CpuFeatures& f = cpu_features();
  CpuClassRates r;
  if (id.amd && id.family == 0x19 && f.avx512f) {  // family 19h with AVX-512: Zen 4 (Zen 3 has none)
    r.name = "AMD Zen 4";
    // Four 256-bit FP pipes, two of which multiply; a 512-bit op takes a pair: one zmm FMA or dot product per cycle.
    r.fma_zmm = r.bf16_zmm = r.vnni_zmm = 1;
    r.source = "AMD Software Optimization Guide for Zen 4 (pub. 57647), FP pipes";
  } else if (id.amd && id.family == 0x1a) {
    r.name = "AMD Zen 5";
    // EPYC 9005 / Ryzen 9000: the FP pipes are 512 bits wide, two of them multiply.
    r.fma_zmm = r.bf16_zmm = r.vnni_zmm = 2;
    r.source = "AMD Software Optimization Guide for Zen 5 (pub. 58455), 512-bit FP datapath with two FMA pipes";
  } else if (id.intel && f.amx_tile) {
    r.name = "Intel Xeon with AMX (Sapphire / Emerald / Granite Rapids)";
    // Ports 0 (fused 0+1) and 5 each take a 512-bit FMA; the AMX TMUL does 1024 bf16 FLOP or 2048 int8 OP per
    // cycle, i.e. one 16x16x32 tdpbf16ps or 16x16x64 tdpbusd every 16 cycles. vdpbf16ps / vpdpbusd: not assumed.
    r.fma_zmm = 2;
    r.amx_tile = 1.0 / 16;
    r.source = "Intel 64 and IA-32 Architectures Optimization Reference Manual, AMX chapter (TMUL: 16 cycles per tile op)";
  }
  return r;
}

namespace {

// Every thread runs loop(iterations); the rate counts all threads' instructions over the wall time, or
// (cpu_clock) sums each thread's instructions over its own CPU time.
PeakResult run_peak(int64_t iterations, double ops_per_instruction, bool cpu_clock,
                    const std::function<double(int64_t)>& loop) {
  PeakResult r;
  r.threads = num_threads();
  double sums[256] = {}, rates[256] = {}, starts[256] = {}, ends[256] = {};
  // Timed from a barrier inside the region, each thread its own start and end: the time the runtime takes to
  // wake a sleeping pool thread (~0.1 ms on the Zen 4 VM, 10% of a 1 ms run) is not the instruction's.
#pragma omp parallel num_threads(r.threads)
  {
    const int t = omp_get_thread_num() % 256;
#pragma omp barrier
    starts[t] = now_seconds(false);
    const double cpu_start = thread_cpu_seconds();
    sums[t] = loop(iterations);
    rates[t] = iterations * x86::kPeakChains / (thread_cpu_seconds() - cpu_start);
    ends[t] = now_seconds(false);
  }
  const double seconds = *std::max_element(ends, ends + r.threads) - *std::min_element(starts, starts + r.threads);
  for (double s : sums) r.checksum += s;
  r.instructions = iterations * x86::kPeakChains * r.threads;
  if (cpu_clock) {
    for (double rate : rates) r.per_second += rate * ops_per_instruction;
  } else {
    r.per_second = static_cast<double>(r.instructions) * ops_per_instruction / seconds;
  }
  return r;
}

}  // namespace

PeakResult dot_peak_bf16(int64_t iterations_per_thread, bool cpu_clock) {
  if (!use_x86_kernels() || !cpu_features().has_avx512_bf16_kernels()) return {};
  volatile uint16_t one = 0x3f80;  // bf16 1.0, read at run time so nothing folds
  return run_peak(iterations_per_thread, 64.0, cpu_clock, [&](int64_t n) { return x86::dpbf16_loop_avx512bf16(n, one); });
}

PeakResult dot_peak_vnni(int64_t iterations_per_thread, bool cpu_clock) {
  if (!use_x86_kernels() || !cpu_features().has_avx512_vnni_kernels()) return {};
  volatile uint8_t one = 1;
  return run_peak(iterations_per_thread, 128.0, cpu_clock, [&](int64_t n) { return x86::dpbusd_loop_avx512vnni(n, one); });
}

PeakResult dot_peak_amx_bf16(int64_t iterations_per_thread, bool cpu_clock) {
  if (!use_amx_kernels()) return {};
  volatile uint16_t one = 0x3f80;
  return run_peak(iterations_per_thread, 16.0 * 16 * 32 * 2, cpu_clock,
                  [&](int64_t n) { return x86::tdpbf16_loop_amx(n, one); });
}

PeakResult dot_peak_amx_int8(int64_t iterations_per_thread, bool cpu_clock) {
  if (!use_amx_kernels()) return {};
  volatile uint8_t one = 1;
  return run_peak(iterations_per_thread, 16.0 * 16 * 64 * 2, cpu_clock,
                  [&](int64_t n) { return x86::tdpbusd_loop_amx(n, one); });
}

PeakResult dot_peak_maddubs(int64_t iterations_per_thread, bool cpu_clock) {
  if (!use_avx2_kernels()) return {};
  volatile uint8_t one = 1;
  return run_peak(iterations_per_thread, 64.0, cpu_clock, [&](int64_t n) { return x86::maddubs_loop_avx2(n, one); });
}

PeakResult fma_peak_f32(int64_t iterations_per_thread, bool cpu_clock) {
  volatile float one = 1.0f;
  if (use_x86_kernels())
    return run_peak(iterations_per_thread, 32.0, cpu_clock, [&](int64_t n) { return x86::fma_loop_avx512(n, one); });
  if (use_avx2_kernels())
    return run_peak(iterations_per_thread, 16.0, cpu_clock, [&](int64_t n) { return x86::fma_loop_avx2(n, one); });
  return {};
}

PeakSet best_peaks(bool cpu_clock, int trials) {
  PeakSet p;
  const auto keep = [](PeakResult& best, const PeakResult& r) {
    if (r.per_second > best.per_second) best = r;
  };
  for (int i = 0; i < trials; ++i) {  // ~1.7 ms each at Zen 4's rate (1 << 17 iterations x 24 instructions)
    keep(p.bf16, dot_peak_bf16(1 << 17, cpu_clock));
    keep(p.vnni, dot_peak_vnni(1 << 17, cpu_clock));
    keep(p.maddubs, dot_peak_maddubs(1 << 17, cpu_clock));
    keep(p.fma, fma_peak_f32(1 << 17, cpu_clock));
    keep(p.amx_bf16, dot_peak_amx_bf16(1 << 13, cpu_clock));
    keep(p.amx_int8, dot_peak_amx_int8(1 << 13, cpu_clock));
  }
  return p;
}

}  // namespace moex::kernels
