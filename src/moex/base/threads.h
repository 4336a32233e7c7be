// Threads: an OpenMP team sized once (--threads / MOEX_THREADS / all cores). OpenMP rather than a
// hand-written pool: its barrier and static schedule are what a GEMV split over rows needs.
#pragma once
#include <omp.h>

#include <cstdint>

namespace moex {

// Threads beyond a few per CPU only add fork/join and context switches (10000 threads turned a 0.03 s run
// into 19 s): --threads and MOEX_THREADS accept 1..kMaxThreadsPerCpu x the CPUs.
inline constexpr int kMaxThreadsPerCpu = 4;
int cpu_count();    // CPUs this process may run on
int max_threads();  // kMaxThreadsPerCpu x the machine's CPUs

// n = 0: MOEX_THREADS if set, else all CPUs. Throws Error(kInvalidInput) for n outside 0..max_threads(), a
// MOEX_THREADS that is not a count in that range, or a bad MOEX_ISA (see check_isa_env()): every command
// that computes calls this first, which makes it the place that reports the environment.
void set_num_threads(int n);
int num_threads();

// set_num_threads pins the calling thread to the first CPU, and a thread inherits its creator's mask: a
// std::thread started afterwards (an engine thread, HTTP workers) would otherwise run on that one CPU with
// every OpenMP worker it creates (serve's decode took 1.7x bench decode's time per step until this).
// unpin_this_thread(): back to the process's CPUs (call before starting threads that must not be pinned).
// become_compute_thread(): this thread runs the forward passes from now on; it and its OpenMP team are
// pinned as set_num_threads pinned the calling thread's.
void unpin_this_thread();
void become_compute_thread();

// Splits [0, n) into contiguous ranges, one per thread, each a multiple of `grain` (except the last).
template <typename Fn>
void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
  const int threads = num_threads();
  if (threads <= 1 || n <= grain) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t chunks = (n + grain - 1) / grain;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int64_t per = (chunks + threads - 1) / threads;
    const int64_t begin = t * per * grain, end = (t + 1) * per * grain < n ? (t + 1) * per * grain : n;
    if (begin < end) fn(begin, end);
  }
}

}  // namespace moex
