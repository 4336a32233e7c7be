#include "moex/base/threads.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "moex/base/cpu.h"
#include "moex/base/error.h"

namespace moex {
namespace {

// MOEX_THREADS as a count (0: all cores), or nullopt when it is unset or empty. Throws naming the variable
// when it is not an integer in 0..max_threads().
std::optional<int> env_threads() {
  const char* env = std::getenv("MOEX_THREADS");
  if (!env || !*env) return std::nullopt;
  int n = -1;
  const char* end = env + std::strlen(env);
  const auto [ptr, ec] = std::from_chars(env, end, n);
  MOEX_CHECK_INPUT(ec == std::errc() && ptr == end && n >= 0 && n <= max_threads(), "MOEX_THREADS='", env,
                   "' must be a whole number of threads in 0..", max_threads(), " (0: all ", cpu_count(),
                   " CPUs of this machine)");
  return n;
}

// Static initialisation cannot report a bad MOEX_THREADS (no command runs yet): it takes all cores, and
// set_num_threads(0), which every command calls, reports it.
int initial_threads() {
  try {
    const std::optional<int> n = env_threads();
    return n && *n > 0 ? *n : cpu_count();
  } catch (const Error&) {
    return cpu_count();
  }
}
int g_threads = initial_threads();

// The process's CPUs as they were before pin_threads narrowed the calling thread's mask to one CPU.
struct ProcessCpus {
  cpu_set_t mask;
  bool known = false;
};
ProcessCpus& process_cpus() {
  static ProcessCpus cpus = [] {
    ProcessCpus c;
    CPU_ZERO(&c.mask);
    c.known = sched_getaffinity(0, sizeof(c.mask), &c.mask) == 0;
    return c;
  }();
  return cpus;
}

}  // namespace

int cpu_count() { return std::max(1, omp_get_num_procs()); }

int max_threads() {
  const int machine = std::max<int>(cpu_count(), static_cast<int>(std::thread::hardware_concurrency()));
  return kMaxThreadsPerCpu * machine;
}

// One thread per CPU of this process's affinity mask: pin thread i to CPU i, as OMP_PROC_BIND=true would
// (the environment variable is read before main, so it cannot be set from the command). Measured on the
// 2-core VM: batch-1 decode on mini went from 43-48% to 50-60% of the read roofline. Skipped when the
// process has fewer CPUs than threads (mpirun binding, taskset) and with MOEX_PIN_THREADS=0.
void pin_threads(int threads) {
  const char* env = std::getenv("MOEX_PIN_THREADS");
  if ((env && std::atoi(env) == 0) || threads < 2) return;
  const ProcessCpus& process = process_cpus();
  if (!process.known) return;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &process.mask)) cpus.push_back(c);
  if (static_cast<int>(cpus.size()) != threads) return;
#pragma omp parallel num_threads(threads)
  {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpus[omp_get_thread_num()], &one);
    pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
  }
}

void set_num_threads(int n) {
  check_isa_env();
  MOEX_CHECK_INPUT(n >= 0 && n <= max_threads(), "--threads ", n, " must be in 1..", max_threads(), " (",
                   kMaxThreadsPerCpu, " per CPU; this machine has ", cpu_count(), "; 0: all CPUs)");
  if (n == 0) {
    const std::optional<int> env = env_threads();
    n = env && *env > 0 ? *env : cpu_count();
  }
  g_threads = n;
  pin_threads(g_threads);
}
int num_threads() { return g_threads; }

void unpin_this_thread() {
  const ProcessCpus& process = process_cpus();
  if (process.known) pthread_setaffinity_np(pthread_self(), sizeof(process.mask), &process.mask);
}

void become_compute_thread() {
  unpin_this_thread();
  pin_threads(g_threads);
}

}  // namespace moex
