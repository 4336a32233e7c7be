#include "moex/base/threads.h"

#include <cstdlib>

namespace moex {
namespace {
int initial_threads() {
  const char* env = std::getenv("MOEX_THREADS");
  int n = env ? std::atoi(env) : 0;
  return n > 0 ? n : omp_get_num_procs();
}
int g_threads = initial_threads();
}  // namespace

void set_num_threads(int n) { g_threads = n > 0 ? n : omp_get_num_procs(); }
int num_threads() { return g_threads; }

}  // namespace moex
