// The format table, the kernel registry and the one place that decides format x ISA x row loop.
#include "moex/kernels/formats.h"

#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <string>
#include <string_view>

#include "moex/base/error.h"
#include "moex/kernels/formats/format.h"
#include "moex/kernels/x86/packed_x86.h"

namespace moex::kernels {
namespace {

// The format table: each format's definition, in WeightFormat order (MOEX_WEIGHT_FORMATS).
#define MOEX_WEIGHT_FORMAT_ADDRESS(value, file) &format_##file,
constexpr const FormatDef* kFormats[] = {MOEX_WEIGHT_FORMATS(MOEX_WEIGHT_FORMAT_ADDRESS)};
#undef MOEX_WEIGHT_FORMAT_ADDRESS
static_assert(std::size(kFormats) == kWeightFormats);

bool quantized_activations(WeightFormat f) {
  const ActivationKind a = format_traits(f).activations;
  return a == ActivationKind::kS8PerToken || a == ActivationKind::kS8PerGroup;
}

// -1 auto, 0 few, 1 many, 2 a bad value.
int parse_row_kernel_env() {
  static const int parsed = [] {
    const char* v = std::getenv("MOEX_ROW_KERNEL");
    const std::string_view s = v ? v : "";
    return s.empty() || s == "auto" ? -1 : s == "few" ? 0 : s == "many" ? 1 : 2;
  }();
  return parsed;
}

// int4's and fp8's many-row calls on CPUs with AMX (Intel Xeons) run tiles where this process may use them
// (weight_only_many_rows_on_amx, below); else (MOEX_ISA=avx512, the tile state refused) the f32-FMA kernels (kAvx512)
// instead of their vdpbf16ps ones: there vdpbf16ps runs at half the FLOP rate of vfmadd231ps (measured on such a
// Xeon: 106-110 against 218 GFLOPS per core; Zen 4/5 run it at twice vfmadd's rate), and at many rows the dot
// products, not the weight decode, bound the call: the FMA loops take 0.62-0.64x the time at 512 rows. At a few rows
// the bf16 route, which decodes a weight in fewer instructions, stays faster, so the few-row loop keeps it.
bool many_rows_on_fma(WeightFormat format, Isa isa) {
  return isa == Isa::kAvx512Bf16 && !format_traits(format).row_kernels_agree &&
         format_traits(format).activations == ActivationKind::kBf16 && cpu_features().has_amx_kernels();
}

// Whether a weight-only format whose few-row loop runs on `isa` has a many-row loop on AMX tiles (on a CPU with
// them): fp8's and int4's beside their vdpbf16ps loops (their decodes need VBMI: without it they are on kAvx512 and
// have none), int8's beside its f32-FMA loop (kAvx512).
bool has_weight_only_tiles(WeightFormat format, Isa isa) {
  return !format_traits(format).row_kernels_agree && find_kernel(format, Isa::kAmx, RowKernel::kManyRows) &&
         below_amx(format) == isa;
}

// Those many-row calls go to tiles where this process may use them (use_amx_kernels: the CPU has AMX, Linux
// granted the tile state, MOEX_ISA is not avx512): their codes decoded to bf16 pairs once per panel and K group,
// then tdpbf16ps (expert_gemm_amx.cc); int8's tiles read the activations split into bf16 (hi, lo) pairs, near f32.
bool weight_only_many_rows_on_amx(WeightFormat format, Isa isa) {
  return has_weight_only_tiles(format, isa) && use_amx_kernels();
}

}  // namespace

const FormatDef& format_def(WeightFormat format) {
  const auto i = static_cast<size_t>(format);
  MOEX_CHECK(i < kWeightFormats && kFormats[i]->traits.format == format, "no such weight format");
  return *kFormats[i];
}

const FormatTraits& format_traits(WeightFormat format) { return format_def(format).traits; }

std::span<const FormatTraits> all_formats() {
  static const std::vector<FormatTraits> rows = [] {
    std::vector<FormatTraits> r;
    for (const FormatDef* f : kFormats) r.push_back(f->traits);
    return r;
  }();
  return rows;
}

std::string_view weight_format_name(WeightFormat format) { return format_traits(format).name; }

std::optional<WeightFormat> weight_format_from_name(std::string_view name) {
  for (const FormatDef* f : kFormats)
    if (f->traits.name == name || (!f->traits.alias.empty() && f->traits.alias == name)) return f->traits.format;
  return std::nullopt;
}

double packed_bytes_per_weight(WeightFormat format, double group, double cols) {
  const FormatTraits& t = format_traits(format);
  double bytes = t.code_bits / 8.0;
  const double per_scale = t.grouped ? (t.fixed_group ? static_cast<double>(t.fixed_group) : group) : cols;
  for (uint8_t b : {kScalesBuffer, kOffsetsBuffer, kColSumsBuffer})
    if (t.buffers & b) bytes += 4.0 / (b == kColSumsBuffer ? cols : per_scale);
  return bytes;
}

std::span<const KernelEntry> registered_kernels() {
  static const std::vector<KernelEntry> rows = [] {
    std::vector<KernelEntry> r;
    for (const FormatDef* f : kFormats)
      for (const IsaKernels& k : f->kernels) {
        r.push_back({f->traits.format, k.isa, RowKernel::kFewRows, k.few, k.activations});
        if (k.many) r.push_back({f->traits.format, k.isa, RowKernel::kManyRows, k.many, k.activations, k.from, k.same_bits});
      }
    return r;
  }();
  return rows;
}

const KernelEntry* find_kernel(WeightFormat format, Isa isa, RowKernel loop) {
  for (const KernelEntry& k : registered_kernels())
    if (k.format == format && k.isa == isa && k.loop == loop) return &k;
  return nullptr;
}

int64_t many_rows_from(WeightFormat format, Isa isa) {
  const KernelEntry* k = find_kernel(format, isa, RowKernel::kManyRows);
  return k ? k->from : std::numeric_limits<int64_t>::max();
}

int row_kernel_override() {
  validate_kernel_environment();
  return parse_row_kernel_env();
}

namespace x86 {
namespace {
// MOEX_STREAM_PREFETCH: 1 on, 0 off, -1 auto or unset (validate_kernel_environment refuses other values at load).
int stream_prefetch_env() {
  const char* e = std::getenv("MOEX_STREAM_PREFETCH");
  if (e && std::string_view(e) == "on") return 1;
  if (e && std::string_view(e) == "off") return 0;
  return -1;
}
// CPUID vendor "AuthenticAMD" and family (base family 0Fh plus extended family): 0 when not AMD.
unsigned amd_family() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d) || b != 0x68747541 || d != 0x69746e65 || c != 0x444d4163) return 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const unsigned base = (a >> 8) & 0xf, ext = (a >> 20) & 0xff;
  return base == 0xf ? base + ext : base;
#else
  return 0;
#endif
}
const unsigned g_amd_family = amd_family();
}  // namespace
// x86/prefetch.h; all three are set before main, in this order (one translation unit).
extern const int g_stream_prefetch_env = stream_prefetch_env();
extern const bool g_cpu_is_zen5 = g_amd_family == 0x1a;
bool g_stream_prefetch = g_stream_prefetch_env >= 0 ? g_stream_prefetch_env == 1 : g_amd_family == 0;
}  // namespace x86

void validate_kernel_environment() {
  MOEX_CHECK_INPUT(parse_row_kernel_env() != 2, "MOEX_ROW_KERNEL='", std::getenv("MOEX_ROW_KERNEL"),
                   "' (choose auto, few or many)");
  // Read by x86/prefetch.h, which cannot throw inside a kernel: an unknown value there means the CPU's default.
  const char* prefetch = std::getenv("MOEX_STREAM_PREFETCH");
  MOEX_CHECK_INPUT(!prefetch || std::string_view(prefetch) == "on" || std::string_view(prefetch) == "off" ||
                       std::string_view(prefetch) == "auto",
                   "MOEX_STREAM_PREFETCH='", prefetch, "' (choose auto, on or off)");
}

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512bf16";
    case Isa::kAvx512Vnni: return "avx512vnni";
    case Isa::kAmx: return "amx";
  }
  return "?";
}

Isa below_amx(WeightFormat format) {
  if (quantized_activations(format)) return Isa::kAvx512Vnni;
  return format_traits(format).activations == ActivationKind::kF32 ? Isa::kAvx512 : Isa::kAvx512Bf16;
}

// Every format has an AVX2 kernel (the registry's kAvx2 rows): weights decoded to f32 and f32 FMAs for the
// weight-only ones, exact integer sums with vpmaddubsw for the quantized activations.
Isa kernel_isa(WeightFormat format, const CpuFeatures& cpu, bool x86_enabled) {
  if (!x86_enabled) return Isa::kScalar;
  const Isa avx2_or_scalar =
      find_kernel(format, Isa::kAvx2, RowKernel::kFewRows) && cpu.has_avx2_kernels() ? Isa::kAvx2 : Isa::kScalar;
  if (!cpu.has_avx512_kernels()) return avx2_or_scalar;
  // has_amx_kernels() implies AVX512-BF16 and VNNI: kAmx's few-row loops are there.
  const FormatTraits& t = format_traits(format);
  if (t.row_kernels_agree) {  // bf16 on vdpbf16ps, W8A8 / W4A8 on vpdpbusd; tiles above both
    if (cpu.has_amx_kernels()) return Isa::kAmx;
    const bool below = t.activations == ActivationKind::kBf16 ? cpu.has_avx512_bf16_kernels() : cpu.has_avx512_vnni_kernels();
    return below ? below_amx(format) : avx2_or_scalar;
  }
  if (t.activations == ActivationKind::kBf16)  // int4 / fp8: both decodes need VBMI, else the f32-FMA loop
    return cpu.has_avx512_bf16_vbmi_kernels() ? Isa::kAvx512Bf16 : Isa::kAvx512;
  // int8: the s16-code VNNI loop; on AMX CPUs the f32-FMA few-row loop beside tiles
  return !cpu.has_amx_kernels() && cpu.has_avx512_vnni_kernels() ? Isa::kAvx512Vnni : Isa::kAvx512;
}

Isa kernel_isa(WeightFormat format) {
  CpuFeatures cpu = cpu_features();
  if (!use_x86_kernels()) cpu.avx512f = false;  // MOEX_ISA=avx2 on an AVX-512 CPU: what an AVX2-only one runs
  const Isa isa = kernel_isa(format, cpu, use_x86_kernels() || use_avx2_kernels());
  if (isa != Isa::kAmx || use_amx_kernels()) return isa;
  CpuFeatures no_amx = cpu_features();  // MOEX_ISA=avx512, or an AMX CPU under a Linux that refuses the tile state
  no_amx.amx_tile = false;
  return kernel_isa(format, no_amx, true);
}

KernelChoice choose_kernel_on(WeightFormat format, Isa isa) {
  KernelChoice c;
  c.isa = isa;
  if (isa == Isa::kScalar) return c;
  // The few-row loop stays on `isa` (under kAmx: the AVX-512 kernel below it); the many-row one moves to tiles
  // (weight-only formats where this process may use them) or to the f32-FMA loop (int4 / fp8 on AMX CPUs without).
  const Isa outer = weight_only_many_rows_on_amx(format, isa) ? Isa::kAmx : isa;
  const Isa few_isa = outer == Isa::kAmx ? below_amx(format) : outer;
  const Isa many_isa = outer == Isa::kAmx ? Isa::kAmx : many_rows_on_fma(format, outer) ? Isa::kAvx512 : outer;
  const KernelEntry* few = find_kernel(format, few_isa, RowKernel::kFewRows);
  const KernelEntry* many = find_kernel(format, many_isa, RowKernel::kManyRows);
  MOEX_CHECK(few, "no few-row kernel for ", weight_format_name(format), " on ", isa_name(few_isa));
  c.few = {few_isa, few->run, false, few->activations};
  if (many) {
    c.many = {many_isa, many->run, true, many->activations};
    c.many_from = many->from;
    c.row_dependent = !many->same_bits;
  } else {
    c.many = c.few;
  }
  const int pinned = parse_row_kernel_env();
  if (pinned == 0) c.many_from = std::numeric_limits<int64_t>::max();
  if (pinned == 1 && many) c.many_from = 0;
  return c;
}

KernelChoice choose_kernel(WeightFormat format) { return choose_kernel_on(format, kernel_isa(format)); }

Isa isa_for_rows(WeightFormat format, Isa isa, int64_t rows, bool batch_invariant) {
  return choose_kernel_on(format, isa).for_rows(rows, batch_invariant).isa;
}

RowKernel row_kernel_for(WeightFormat format, Isa isa, int64_t rows, bool batch_invariant) {
  return choose_kernel_on(format, isa).for_rows(rows, batch_invariant).many_rows ? RowKernel::kManyRows
                                                                                 : RowKernel::kFewRows;
}

RowKernel row_kernel_on(WeightFormat format, Isa isa, int64_t rows, bool batch_invariant) {
  const KernelEntry* many = find_kernel(format, isa, RowKernel::kManyRows);
  if (!many || (batch_invariant && row_result_depends_on_row_count(format, isa))) return RowKernel::kFewRows;
  const int pinned = parse_row_kernel_env();
  if (pinned >= 0) return pinned ? RowKernel::kManyRows : RowKernel::kFewRows;
  return rows >= many->from ? RowKernel::kManyRows : RowKernel::kFewRows;
}

bool row_result_depends_on_row_count(WeightFormat format, Isa isa) {
  return choose_kernel_on(format, isa).row_dependent;
}

std::vector<Isa> usable_isas(WeightFormat format, const CpuFeatures& cpu) {
  std::vector<Isa> isas = {Isa::kScalar};
  const Isa best = kernel_isa(format, cpu, true);
  const bool avx2 = find_kernel(format, Isa::kAvx2, RowKernel::kFewRows) && cpu.has_avx2_kernels();
  if (best != Isa::kAvx2 && avx2) isas.push_back(Isa::kAvx2);  // tested on AVX-512 CPUs too
  // The f32-FMA loop below int4's / fp8's vdpbf16ps one and int8's s16-code one.
  if (!format_traits(format).row_kernels_agree && best != Isa::kAvx512 && best != Isa::kScalar && best != Isa::kAvx2)
    isas.push_back(Isa::kAvx512);
  if (best == Isa::kAmx) isas.push_back(below_amx(format));
  if (best != Isa::kScalar) isas.push_back(best);
  if (has_weight_only_tiles(format, best) && cpu.has_amx_kernels()) isas.push_back(Isa::kAmx);  // their many rows
  return isas;
}

}  // namespace moex::kernels
