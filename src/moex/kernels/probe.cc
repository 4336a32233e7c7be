#include "moex/kernels/probe.h"

#include <cstdint>
#include <cstring>

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

}  // namespace moex::kernels
