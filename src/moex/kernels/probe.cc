#include "moex/kernels/probe.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>

#include "moex/base/cpu.h"
#include "moex/base/threads.h"

namespace moex::kernels {

float stream_read(const void* data, size_t bytes) {
  const auto* base = static_cast<const uint8_t*>(data);
  constexpr int64_t kBlock = 1 << 16;
  const int64_t blocks = static_cast<int64_t>(bytes / kBlock);
  float partial[256] = {};
  parallel_for(blocks, 1, [&](int64_t begin, int64_t end) {
    float sum = 0.0f;
    if (use_x86_kernels()) {
      sum = x86::stream_read_avx512(base + begin * kBlock, static_cast<size_t>(end - begin) * kBlock);
    } else if (use_avx2_kernels()) {
      sum = x86::stream_read_avx2(base + begin * kBlock, static_cast<size_t>(end - begin) * kBlock);
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

ReplayResult stream_read_steps(const std::vector<StepReads>& steps) {
  const int threads = num_threads();
  float sums[256] = {};
  size_t read[256] = {};
  // One parallel region for all steps and no barrier between ranges: a kernel must also wait for its inputs,
  // so this is a lower bound on the time of any split of the same bytes.
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    float sum = 0.0f;
    size_t n = 0;
    for (const StepReads& step : steps)
      for (const ByteRange& r : step) {
        const size_t lines = (r.bytes + 63) / 64, per = (lines + threads - 1) / threads;
        const size_t begin = std::min(r.bytes, t * per * 64), end = std::min(r.bytes, begin + per * 64);
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

// Every thread runs loop(iterations); the rate counts all threads' instructions over the wall time, or
// (cpu_clock) sums each thread's instructions over its own CPU time.
PeakResult run_peak(int64_t iterations, double ops_per_instruction, bool cpu_clock,
                    const std::function<double(int64_t)>& loop) {
  PeakResult r;
  r.threads = num_threads();
  double sums[256] = {}, rates[256] = {};
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(r.threads)
  {
    const double cpu_start = thread_cpu_seconds();
    sums[omp_get_thread_num() % 256] = loop(iterations);
    rates[omp_get_thread_num() % 256] = iterations * x86::kPeakChains / (thread_cpu_seconds() - cpu_start);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
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

}  // namespace moex::kernels
