// CPU feature detection, read once: kernels dispatch on it at start-up.
#pragma once
#include <string>

namespace moex {

struct CpuFeatures {
  bool avx2 = false, fma = false, avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false, amx_tile = false, amx_bf16 = false;
  // What the AVX-512 kernels in kernels/x86 need.
  bool has_avx512_kernels() const { return avx512f && avx512bw && avx512vl && avx512dq && fma; }
  std::string str() const;
};

const CpuFeatures& cpu_features();
// MOEX_ISA=ref forces the scalar kernels (tests use it to compare the two paths in one binary); avx512
// requires the AVX-512 ones; auto (or unset) takes the best the CPU has.
bool use_x86_kernels();
// Throws Error(kInvalidInput) for a MOEX_ISA that is none of those, or avx512 on a CPU without it.
// set_num_threads() calls it: every command that computes sets its thread count first.
void check_isa_env();
void set_use_x86_kernels(bool enabled);

}  // namespace moex
