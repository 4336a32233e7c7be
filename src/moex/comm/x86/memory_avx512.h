// AVX-512 memory loops of the shared-memory all-reduce (memory_avx512.cc); callers check the CPU first.
#pragma once
#include <cstddef>

namespace moex::comm::x86 {

// dst [count] = src [count] with non-temporal stores (dst is not brought into the cache), then a store fence.
void copy_f32_streaming(float* dst, const float* src, size_t count);
// comm::sum_to_all_f32 (codec.h) for i in [begin, end); streaming stores (and a closing store fence) when
// `streaming`.
void sum_to_all_f32(float* const* buffers, int p, size_t begin, size_t end, bool streaming);

}  // namespace moex::comm::x86
