// The weight formats and the kernel registry: which loop runs a format on which ISA in which row regime, with the
// crossover between its two loops. A weight's choice (KernelChoice) is resolved once, when it is packed or mapped
// (kernels/packed.h), and read by every call. Each format is declared in one file, kernels/formats/<name>.cc (its
// FormatDef, formats/format.h: traits row, quantizer, packing, scalar decode, kernel rows); formats.cc assembles
// the table and decides format x ISA x row loop from the traits.
//
// Adding a format touches four files (docs/kernels.md, "The format table"):
//   1. kernels/formats/<name>.cc   its declaration: traits row, quantizer, lane / panel packing, the scalar decode of
//                                  the packed layout and of the natural one (the oracle's element access), its
//                                  kernels per ISA (IsaKernels) with the ActivationLayout each reads, and the
//                                  declarations of its own kernels;
//   2. kernels/x86/packed_<name>_<isa>.cc   its kernels (PanelJob from x86/packed_x86.h, which need not change);
//   3. tests/unit/kernels_packed_test.cc    its case in kFormats and its error bound: the oracle test then runs every
//                                           registered kernel of it against ref::matmul on ragged shapes;
//   4. this header: its line in MOEX_WEIGHT_FORMATS.
// Kernels that read existing ActivationLayouts get those layouts' conversions as they are. More files only for what
// no format has yet: a new ActivationLayout (its value below and its cases in packed.cc's Activations), a new
// ActivationKind (ref/packed_ref.cc and packed.cc's scalar path compute per kind), and a format a checkpoint stores
// (model/quantization.cc, model/weights.cc, tools/moex/quantize.cc: the stored file's tensors and config, not the
// runtime format).
#pragma once
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "moex/base/cpu.h"

namespace moex::kernels {

// Every weight format, one line each: its WeightFormat value and its file, kernels/formats/<file>.cc, which declares
// all of it (the FormatDef there: traits, quantizer, packing, scalar decode, kernel rows; the format's own comment).
// The only line of this header a new format adds. Order: the table's, and the registry's.
#define MOEX_WEIGHT_FORMATS(X) \
  X(kBF16, bf16)               \
  X(kInt8, int8)               \
  X(kInt8W8A8, int8_w8a8)      \
  X(kInt4, int4)               \
  X(kInt4W4A8, int4_w4a8)      \
  X(kFP8E4M3, fp8_e4m3)

#define MOEX_WEIGHT_FORMAT_VALUE(value, file) value,
enum class WeightFormat : uint8_t { MOEX_WEIGHT_FORMATS(MOEX_WEIGHT_FORMAT_VALUE) };
#undef MOEX_WEIGHT_FORMAT_VALUE
#define MOEX_WEIGHT_FORMAT_ONE(value, file) +1
inline constexpr int kWeightFormats = 0 MOEX_WEIGHT_FORMATS(MOEX_WEIGHT_FORMAT_ONE);
#undef MOEX_WEIGHT_FORMAT_ONE

// Which code runs a format. Decided from the CPU (and MOEX_ISA) only; never an ISA the CPU lacks.
// kAmx (bf16, W8A8 and W4A8 on a CPU with AMX) means: AMX tiles for the many-row loop (bf16: every call), the
// AVX-512 kernel below it for the few-row one; int8's, int4's and fp8's many rows move to tiles likewise.
enum class Isa : uint8_t { kScalar, kAvx2, kAvx512, kAvx512Bf16, kAvx512Vnni, kAmx };
std::string_view isa_name(Isa isa);

// The two register-tile loops of a format's kernel. The few-row loop streams each panel once with the weights
// decoded inside its token tile (decode); the many-row loop is a GEMM for prefill (wider tiles, a K block decoded
// once or tiles of 16 rows).
enum class RowKernel : uint8_t { kFewRows, kManyRows };
inline constexpr RowKernel kBatchInvariantRowKernel = RowKernel::kFewRows;  // the pin (docs/serve.md: its cost)

// What a format's activations are, as numbers: what the scalar oracle (ref::matmul) and the scalar loop compute and
// the kernels' results are held to. How one kernel reads them in memory is its ActivationLayout (below).
enum class ActivationKind : uint8_t {
  kF32,         // x as it is (a kernel may read a layout within the f32 path's tolerance: int8's s16 codes, split
                // bf16 planes)
  kBf16,        // rounded to bf16
  kS8PerToken,  // s8 codes, scale = absmax / 127 per token; integer sums, both scales applied to the sum
  kS8PerGroup,  // s8 codes, one absmax / 127 scale per token and K group of the weights
};

// One weight format: everything about it that is data (its code: the hooks beside it in its FormatDef,
// kernels/formats/format.h, and its registered kernels).
struct FormatTraits {
  WeightFormat format;
  std::string_view name;       // --weights' spelling
  uint8_t buffers;             // bit b: PackedWeights buffer b (0 data, 1 scales, 2 offsets, 3 col_sums)
  int64_t k_multiple;          // k_padded = round_up(cols, k_multiple): what a kernel's k step needs
  int code_bits;               // bits per weight in data
  bool data_spans_k_padded;    // data [P][k_padded...] (else [P][cols][64])
  bool grouped;                // scales (and offsets) per K group: [P][G][64], else one per row
  int64_t fixed_group;         // grouped: the codes per scale along K when the format fixes it (fp8: 128); 0: the
                               // user's --group-size sets it
  ActivationKind activations;
  // Whether every loop of every ISA gives a row the same bits whatever the other rows of its call (bf16's loops
  // sum alike, W8A8's and W4A8's integer sums are exact); false: the --batch-invariant pin is needed wherever a
  // format's two loops are both used (KernelChoice::row_dependent).
  bool row_kernels_agree;
  std::string_view alias;      // a second --weights spelling ("fp8"), or empty
};
const FormatTraits& format_traits(WeightFormat format);
std::span<const FormatTraits> all_formats();  // every row, in WeightFormat order
std::string_view weight_format_name(WeightFormat format);
// The format a --weights / --dense-weights value names (its table name or alias: "fp8" names fp8-e4m3), or nullopt.
std::optional<WeightFormat> weight_format_from_name(std::string_view name);
inline bool row_kernels_agree(WeightFormat format) { return format_traits(format).row_kernels_agree; }
// Whether --group-size sets the format's K group (int4, int4-w4a8).
inline bool group_is_user_set(WeightFormat format) {
  return format_traits(format).grouped && format_traits(format).fixed_group == 0;
}
// Bytes per weight of the packed copy, codes and scales (run-memory estimates): a matrix of `cols` columns and
// `group` codes per scale (ignored by formats without groups).
double packed_bytes_per_weight(WeightFormat format, double group, double cols);

namespace x86 {
struct PanelJob;
}
// Panels [begin, end) of one job (kernels/x86/packed_x86.h).
using PanelKernel = void (*)(const x86::PanelJob& job, int64_t panel_begin, int64_t panel_end);

// How a kernel reads a call's activations x [T][K] (f32): the conversion packed.cc's Activations does once per call
// and row, whatever the weight's format. Each format's kernels on each ISA name theirs (IsaKernels); a kernel that
// reads one no kernel reads yet adds a value here and its case in each of Activations' switches (size_for, convert,
// elementwise, convert_columns, bind). T rows; kp = k_padded; G = K groups of the weights (1 when ungrouped).
enum class ActivationLayout : uint8_t {
  kF32,                    // x itself, [T][K] (nothing converted)
  kF32RoundedBf16,         // f32 [T][K], each value rounded to bf16
  kF32RoundedBf16Sums,     // as kF32RoundedBf16, and [T][G] sums of each K group (group_sums)
  kBf16,                   // bf16 [T][kp], zero tail
  kBf16Sums,               // as kBf16, and [T][G] sums of each K group's bf16 values (group_sums)
  kBf16SplitPlanes,        // bf16 (hi, lo) planes [T][split_row_stride(K)], hi + lo near x (x86/packed_x86.h)
  kS16Codes128,            // s16 codes [T][int8_activation_stride(K)] and a scale per 128-k group (token_scales)
  kU8PerToken,             // u8 q + 128 [T][kp] (zero tail: 128), q the s8 codes of quantize_activations_s8; [T]
                           // scales (token_scales); quantized by the AVX-512 code
  kS8PerToken,             // s8 codes q [T][kp] (zero tail) and [T] scales, quantized by the portable code
  kS8PerGroupSums,         // s8 codes [T][kp] (zero tail), [T][G] scales, one per K group (token_scales), [T][G]
                           // sums of each group's codes (group_sums); quantized by the portable code
  kS8PerGroupSumsAvx512,   // the same bytes, quantized by the AVX-512 code (its q + 128 with the top bit flipped)
};

// One format's kernels on one ISA, as its file declares them: the few-row loop, the many-row loop (nullptr: none)
// with its measured crossover `from` (calls of at least that many rows run it; docs/kernels.md), whether the
// many-row loop gives a row the bits of the few-row one (`same_bits`: then no --batch-invariant pin is needed), and
// the activation layout both loops read.
struct IsaKernels {
  Isa isa;
  ActivationLayout activations;
  PanelKernel few;
  PanelKernel many = nullptr;
  int64_t from = 0;
  bool same_bits = true;
};

// The registry: one row per (format, ISA, loop), made from the formats' IsaKernels.
struct KernelEntry {
  WeightFormat format;
  Isa isa;
  RowKernel loop;
  PanelKernel run;
  ActivationLayout activations = ActivationLayout::kF32;
  int64_t from = 0;        // many-row rows: IsaKernels::from
  bool same_bits = true;   // many-row rows: IsaKernels::same_bits
};
std::span<const KernelEntry> registered_kernels();  // in format order, each format's in its file's order
const KernelEntry* find_kernel(WeightFormat format, Isa isa, RowKernel loop);  // nullptr: none

// What a call of some rows runs: the ISA, the panel loop, whether it is the many-row one (PanelJob::many_rows) and
// the layout its activations are converted to. kScalar: the scalar loop over the packed layout, run = nullptr.
struct RowRegime {
  Isa isa = Isa::kScalar;
  PanelKernel run = nullptr;
  bool many_rows = false;
  ActivationLayout activations = ActivationLayout::kF32;
};
// A weight's kernels, resolved once (choose_kernel) and stored on its PackedWeights.
struct KernelChoice {
  Isa isa = Isa::kScalar;  // kernel_isa's: the format's best on this CPU under MOEX_ISA
  RowRegime few, many;
  int64_t many_from = std::numeric_limits<int64_t>::max();  // rows from which `many` runs (MOEX_ROW_KERNEL applied)
  bool row_dependent = false;  // the two loops sum in different orders: --batch-invariant pins `few`
  const RowRegime& for_rows(int64_t rows, bool batch_invariant) const {
    if (batch_invariant && row_dependent) return few;
    return rows >= many_from ? many : few;
  }
};
// For `format` on this CPU and process (kernel_isa(format), AMX tiles where use_amx_kernels()).
KernelChoice choose_kernel(WeightFormat format);
// For `format` with `isa` as its kernel_isa (tests, benchmarks, `moex info`; packed_matmul_on).
KernelChoice choose_kernel_on(WeightFormat format, Isa isa);
// The many-row loop's crossover on `isa` (the registry's `from`), or max when it has no many-row loop there.
int64_t many_rows_from(WeightFormat format, Isa isa);

// MOEX_ROW_KERNEL=auto|few|many: -1 auto, else the loop every call runs (a benchmark's A/B switch; the
// --batch-invariant pin still wins where the loops differ). Parsed and checked once, on first use, which is the
// first packing at load (a bad value: Error(kInvalidInput), exit 2); validate_kernel_environment() forces it.
int row_kernel_override();
void validate_kernel_environment();

Isa kernel_isa(WeightFormat format, const CpuFeatures& cpu, bool x86_enabled);
// For this CPU and use_x86_kernels(); kAmx only where use_amx_kernels() (Linux granted the tile state, MOEX_ISA
// is not avx512).
Isa kernel_isa(WeightFormat format);
// The ISA a call of `rows` rows runs when `isa` is the format's kernel_isa (choose_kernel_on(format, isa)).
Isa isa_for_rows(WeightFormat format, Isa isa, int64_t rows, bool batch_invariant = false);
// The loop such a call runs.
RowKernel row_kernel_for(WeightFormat format, Isa isa, int64_t rows, bool batch_invariant = false);
// The loop of `isa`'s own registered kernels for such a call (no move to tiles or FMAs: packed_matmul_on).
RowKernel row_kernel_on(WeightFormat format, Isa isa, int64_t rows, bool batch_invariant = false);
// Whether format's kernel on isa has two row loops that sum in different orders, so that without the
// --batch-invariant pin a row's result depends on how many rows its call has (choose_kernel_on(...).row_dependent):
// the weight-only tiles and f32-FMA kernels (int8 / int4 / fp8 on kAmx and kAvx512; int4 / fp8 on kAvx512Bf16 only
// on AMX CPUs, which send their many rows to tiles or the f32-FMA loop).
bool row_result_depends_on_row_count(WeightFormat format, Isa isa);
// Every ISA this CPU can run a format on: kernel_isa's choice and the ones below it (kScalar always).
std::vector<Isa> usable_isas(WeightFormat format, const CpuFeatures& cpu);
// The AVX-512 kernel that runs kAmx's few-row loop.
Isa below_amx(WeightFormat format);

}  // namespace moex::kernels
