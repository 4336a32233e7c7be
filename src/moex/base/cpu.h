// CPU feature detection, read once: kernels dispatch on it at start-up.
#pragma once
#include <string>

namespace moex {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false, avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false, avx512_vbmi = false, amx_tile = false, amx_bf16 = false;
  bool avx512_vnni = false, amx_int8 = false;
  // The OS saves the state (XCR0): AVX needs the YMM bits, AVX-512 opmask + ZMM bits, AMX the tile config +
  // data bits. A CPU flag without them means the instructions fault, so every has_* below requires them.
  bool os_avx = false, os_avx512 = false, os_amx = false;
  // What each family of kernels in kernels/x86 needs; one per file suffix there (*_avx2.cc, *_avx512.cc, ...).
  bool has_avx2_kernels() const { return avx2 && fma && f16c && os_avx; }
  bool has_avx512_kernels() const { return avx512f && avx512bw && avx512vl && avx512dq && fma && os_avx512; }
  bool has_avx512_bf16_kernels() const { return has_avx512_kernels() && avx512_bf16; }
  // + AVX512-VBMI (vpermt2b: byte tables), for fp8's table decode. Not implied by BF16 (Cooper Lake lacks it).
  bool has_avx512_bf16_vbmi_kernels() const { return has_avx512_bf16_kernels() && avx512_vbmi; }
  bool has_avx512_vnni_kernels() const { return has_avx512_kernels() && avx512_vnni; }
  // CPU and OS support only: a process must still ask Linux for the tile state (request_amx_permission).
  bool has_amx_kernels() const { return has_avx512_kernels() && amx_tile && amx_bf16 && amx_int8 && os_amx; }
  std::string str() const;
};

const CpuFeatures& cpu_features();
// Asks Linux (arch_prctl ARCH_REQ_XCOMP_PERM) for the AMX tile state once per process; false when the CPU,
// the OS or the kernel version says no. AMX kernels may run only after this returned true.
bool request_amx_permission();
// MOEX_ISA=ref forces the scalar kernels (tests use it to compare the two paths in one binary); avx512
// requires the AVX-512 ones and leaves AMX tiles out (an A/B switch on AMX CPUs); avx2 runs the AVX2 kernels as on
// a CPU without AVX-512 (use_x86_kernels() false, use_avx2_kernels() true); auto (or unset) takes the best the CPU has.
bool use_x86_kernels();
// AMX tile kernels: use_x86_kernels(), an AMX CPU and OS, Linux granted the tile state, and MOEX_ISA is not avx512.
bool use_amx_kernels();
// Throws Error(kInvalidInput) for a MOEX_ISA that is none of those, or avx512 / avx2 on a CPU without it.
// set_num_threads() calls it: every command that computes sets its thread count first.
void check_isa_env();
// The weight-only packed matmuls also have AVX2 + FMA kernels (kernels/x86/*_avx2.cc) for CPUs without
// AVX-512; everything else runs its scalar loop there. False under MOEX_ISA=ref or set_use_x86_kernels(false).
bool use_avx2_kernels();
// Tests switch between the paths in one process: false forces the scalar loops (AVX2 ones included).
void set_use_x86_kernels(bool enabled);
// What to restore after such a switch: whether vector kernels are allowed at all (false under MOEX_ISA=ref or
// after set_use_x86_kernels(false)). Not use_x86_kernels(), which is false on an AVX2-only CPU: restoring that
// would turn the AVX2 kernels off for the rest of the process.
bool x86_kernels_allowed();

}  // namespace moex
