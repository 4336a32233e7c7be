#include "moex/base/cpu.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "moex/base/error.h"

namespace moex {
namespace {

// XCR0 via xgetbv, only when CPUID says the OS enabled it (OSXSAVE); the asm needs no -mxsave.
uint64_t read_xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  uint64_t xcr0 = 0;
  if (__get_cpuid(1, &a, &b, &c, &d)) {
    f.fma = c & bit_FMA;
    f.f16c = c & bit_F16C;
    if (c & bit_OSXSAVE) xcr0 = read_xcr0();
  }
  // XCR0 bits: 1 SSE, 2 AVX, 5 opmask, 6 ZMM0-15 upper halves, 7 ZMM16-31; 17 tile config, 18 tile data.
  f.os_avx = (xcr0 & 0x6) == 0x6;
  f.os_avx512 = (xcr0 & 0xe6) == 0xe6;
  f.os_amx = f.os_avx512 && (xcr0 & 0x60000) == 0x60000;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
    f.avx2 = b & bit_AVX2;
    f.avx512f = b & bit_AVX512F;
    f.avx512dq = b & bit_AVX512DQ;
    f.avx512bw = b & bit_AVX512BW;
    f.avx512vl = b & bit_AVX512VL;
    f.avx512_vbmi = c & (1u << 1);
    f.avx512_vnni = c & (1u << 11);
    f.amx_bf16 = d & (1u << 22);
    f.amx_tile = d & (1u << 24);
    f.amx_int8 = d & (1u << 25);
  }
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) f.avx512_bf16 = a & (1u << 5);
  return f;
}

// MOEX_ISA, read before main: unset, "" or "auto" picks the best kernels; "ref" the scalar ones; "avx512"
// insists on AVX-512 (no AMX tiles); "avx2" runs what an AVX2-only CPU runs (tests and A/B runs of the AVX2
// kernels on an AVX-512 host). A bad value cannot be reported here (no command is running yet): it leaves the default
// in place and check_isa_env() reports it when the command starts.
enum class IsaSetting { kAuto, kRef, kAvx512, kAvx2, kInvalid };

IsaSetting isa_setting() {
  const char* isa = std::getenv("MOEX_ISA");
  if (!isa || !*isa || std::strcmp(isa, "auto") == 0) return IsaSetting::kAuto;
  if (std::strcmp(isa, "ref") == 0) return IsaSetting::kRef;
  if (std::strcmp(isa, "avx512") == 0) return IsaSetting::kAvx512;
  if (std::strcmp(isa, "avx2") == 0) return IsaSetting::kAvx2;
  return IsaSetting::kInvalid;
}

bool initial_use_x86() {
  const IsaSetting setting = isa_setting();
  return setting != IsaSetting::kRef && setting != IsaSetting::kAvx2 && cpu_features().has_avx512_kernels();
}

bool g_use_x86 = initial_use_x86();
bool g_x86_allowed = isa_setting() != IsaSetting::kRef;  // MOEX_ISA is not ref (the AVX2 kernels ask this)

}  // namespace

std::string CpuFeatures::str() const {
  std::string out;
  auto add = [&](bool on, const char* name) {
    if (on) out += (out.empty() ? "" : " ") + std::string(name);
  };
  add(avx2, "avx2");
  add(fma, "fma");
  add(f16c, "f16c");
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512vl, "avx512vl");
  add(avx512dq, "avx512dq");
  add(avx512_bf16, "avx512_bf16");
  add(avx512_vbmi, "avx512_vbmi");
  add(amx_tile, "amx_tile");
  add(amx_bf16, "amx_bf16");
  add(avx512_vnni, "avx512_vnni");
  add(amx_int8, "amx_int8");
  if ((avx512f && !os_avx512) || (amx_tile && !os_amx)) add(true, "(os-disabled state)");
  return out.empty() ? "none" : out;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

void check_isa_env() {
  const IsaSetting setting = isa_setting();
  MOEX_CHECK_INPUT(setting != IsaSetting::kInvalid, "MOEX_ISA='", std::getenv("MOEX_ISA"),
                   "' is not a kernel set (valid: auto, ref, avx512 = AVX-512 without AMX tiles, avx2 = the AVX2 kernels)");
  MOEX_CHECK_INPUT(setting != IsaSetting::kAvx512 || cpu_features().has_avx512_kernels(),
                   "MOEX_ISA=avx512, but this CPU lacks AVX-512 F/BW/VL/DQ with FMA (it has: ", cpu_features().str(),
                   "); use MOEX_ISA=ref or unset it");
  MOEX_CHECK_INPUT(setting != IsaSetting::kAvx2 || cpu_features().has_avx2_kernels(),
                   "MOEX_ISA=avx2, but this CPU lacks AVX2 with FMA and F16C (it has: ", cpu_features().str(),
                   "); use MOEX_ISA=ref or unset it");
}

bool request_amx_permission() {
  static const bool granted = [] {
    if (!cpu_features().has_amx_kernels()) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;  // from asm/prctl.h (Linux 5.16+)
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
  }();
  return granted;
}

bool use_x86_kernels() { return g_use_x86; }
bool use_amx_kernels() { return g_use_x86 && isa_setting() != IsaSetting::kAvx512 && request_amx_permission(); }
bool use_avx2_kernels() { return g_x86_allowed && cpu_features().has_avx2_kernels(); }
bool x86_kernels_allowed() { return g_x86_allowed; }
void set_use_x86_kernels(bool enabled) {
  g_x86_allowed = enabled;
  g_use_x86 = enabled && isa_setting() != IsaSetting::kAvx2 && cpu_features().has_avx512_kernels();
}

}  // namespace moex
