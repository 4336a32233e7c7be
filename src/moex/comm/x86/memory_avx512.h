// AVX-512 memory loops of the shared-memory all-reduce (memory_avx512.cc); callers check the CPU first.
#pragma once
#include <cstddef>

namespace moex::comm::x86 {

// dst [count] = src [count] with non-temporal stores (dst is not brought into the cache), then a store fence.
void copy_f32_streaming(float* dst, const float* src, size_t count);
// dst [count] += src [count]
void add_f32(const float* src, size_t count, float* dst);
// For i in [0, count): s = buffers[0][i] + ... + buffers[p-1][i] (in that order), then s is stored to every
// buffers[j][i]. Streaming stores (and a closing store fence) when `streaming`.
void sum_to_all_f32(float* const* buffers, int p, size_t count, bool streaming);

}  // namespace moex::comm::x86
