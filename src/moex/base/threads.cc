#include "moex/base/threads.h"

#include <pthread.h>
#include <sched.h>

#include <cstdlib>
#include <vector>

namespace moex {
namespace {
int initial_threads() {
  const char* env = std::getenv("MOEX_THREADS");
  int n = env ? std::atoi(env) : 0;
  return n > 0 ? n : omp_get_num_procs();
}
int g_threads = initial_threads();
}  // namespace

// One thread per CPU of this process's affinity mask: pin thread i to CPU i, as OMP_PROC_BIND=true would
// (the environment variable is read before main, so it cannot be set from the command). Measured on the
// 2-core VM: batch-1 decode on mini went from 43-48% to 50-60% of the read roofline. Skipped when the
// process has fewer CPUs than threads (mpirun binding, taskset) and with MOEX_PIN_THREADS=0.
void pin_threads(int threads) {
  const char* env = std::getenv("MOEX_PIN_THREADS");
  if ((env && std::atoi(env) == 0) || threads < 2) return;
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof(mask), &mask) != 0) return;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &mask)) cpus.push_back(c);
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
  g_threads = n > 0 ? n : omp_get_num_procs();
  pin_threads(g_threads);
}
int num_threads() { return g_threads; }

}  // namespace moex
