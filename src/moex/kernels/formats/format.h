// What a weight format's own file (kernels/formats/<name>.cc, listed in formats.h's MOEX_WEIGHT_FORMATS) defines:
// one FormatDef, its traits row and the code that differs by format. packed.cc, formats.cc and ref/packed_ref.cc
// call these hooks and hold no per-format code; the helpers below are what several quantizers share.
// Internal to kernels/ (the rest of the tree sees formats.h and packed.h).
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "moex/base/tensor.h"
#include "moex/kernels/formats.h"
#include "moex/kernels/packed.h"
#include "moex/kernels/x86/packed_x86.h"

namespace moex::kernels {

// One panel's lanes that hold a row (the others are padding and stay zero): lane[i] for i < n, and per lane
// number the row's codes or bf16 bits [cols] (whichever the format's QuantizedMatrix fills).
struct PanelLanes {
  int n = 0;
  int lane[kPanel] = {};
  const uint8_t* codes[kPanel] = {};
  const uint16_t* bf16[kPanel] = {};
};

struct FormatDef {
  FormatTraits traits;
  // W [rows, cols] (F32 or BF16, any row stride) -> the natural layout. group: --group-size where
  // group_is_user_set(format), else ignored; symmetric: int4's zero point choice (the load's quantizer: true).
  QuantizedMatrix (*quantize)(const TensorView& w, int64_t group, bool symmetric);
  // The dequantized value at (r, c) of the natural layout: the scalar oracle's element access.
  float (*weight)(const QuantizedMatrix& m, int64_t r, int64_t c);
  // Lane `lane` of `panel` takes row `row` of m: its per-lane buffers (scales, offsets, col_sums; nullptr: none).
  void (*pack_lane)(PackedWeights& p, int64_t panel, int lane, const QuantizedMatrix& m, int64_t row);
  // The panel's data, from its lanes' rows (packed.h's layout for the format; data is zero-filled).
  void (*pack_panel)(PackedWeights& p, int64_t panel, const PanelLanes& lanes);
  // The packed weight at (panel, lane, k) as the kernels read it: the scalar path over the packed layout (W8A8:
  // the integer code, its scales applied to the integer sum).
  float (*packed_weight)(const PackedWeights& w, int64_t panel, int lane, int64_t k);
  // Its kernels, one entry per ISA (formats.h's IsaKernels: both row loops, the crossover, the activation layout
  // they read); the registry's rows (KernelEntry) are made from them.
  std::span<const IsaKernels> kernels;
};

const FormatDef& format_def(WeightFormat format);

// The f32-FMA kernels the weight-only formats share (x86/packed_weight_only_*.cc: each decodes the panel's weights to
// f32 through its format's packed layout), given the layout the format's activations are read in. AVX2 has one loop
// for every row count; AVX-512's decoded-block loop runs from 16 rows and sums in another order than its few-row
// one (docs/kernels.md, "Crossovers").
constexpr IsaKernels weight_only_avx2(ActivationLayout activations) {
  return {Isa::kAvx2, activations, x86::run_panels_weight_only_avx2};
}
constexpr IsaKernels weight_only_avx512(ActivationLayout activations) {
  return {Isa::kAvx512, activations, x86::run_panels_weight_only_avx512, x86::run_panels_weight_only_avx512, 16, false};
}

// Each format file's definition (constant-initialized: no code runs before main to build the table).
#define MOEX_WEIGHT_FORMAT_DEF(value, file) extern const FormatDef format_##file;
MOEX_WEIGHT_FORMATS(MOEX_WEIGHT_FORMAT_DEF)
#undef MOEX_WEIGHT_FORMAT_DEF

// The buffer bits of FormatTraits::buffers (PackedWeights::buffer(b): bit b).
inline constexpr uint8_t kDataBuffer = 1, kScalesBuffer = 2, kOffsetsBuffer = 4, kColSumsBuffer = 8;

namespace format_util {

void check_source(const TensorView& w, const char* what);
// Row r of an F32 or BF16 matrix as f32: the mapping itself (F32), else widened into `buffer` (BF16, exact).
const float* source_row(const TensorView& w, int64_t r, std::vector<float>& buffer);
// std::nearbyint (round half to even, the default rounding mode) for |v| <= 2^22, NaN to NaN, in plain arithmetic
// the compiler vectorizes: v + 1.5 * 2^23 lands where the float spacing is 1. The quantizers' arguments are at
// most 127 in magnitude (a weight over its row's or group's scale).
inline float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }
// max |x[c]| over c < n, NaNs skipped (as std::max(m, |x|) from 0 does), in 16 independent maxima: one chain
// of maxss was the whole of int8 quantization's time at load.
float abs_max(const float* x, int64_t n);
QuantizedMatrix empty_matrix(WeightFormat format, int64_t rows, int64_t cols, int64_t group = 0);
// Quantizing a Mixtral-sized model is ~10^11 element visits: rows (or row blocks) go to all threads.
void for_each_index(int64_t n, const std::function<void(int64_t)>& fn);
// The natural layouts int8 and W8A8 share (w = q * scale[row]), and int4 and W4A8 (w = (q - zero) * scale per
// row and K group).
inline float s8_per_row_weight(const QuantizedMatrix& m, int64_t r, int64_t c) {
  return static_cast<float>(static_cast<int8_t>(m.codes[r * m.cols + c])) * m.scales[r];
}
inline float int4_grouped_weight(const QuantizedMatrix& m, int64_t r, int64_t c) {
  const int64_t g = r * m.groups() + c / m.group;
  return static_cast<float>(static_cast<int>(m.codes[r * m.cols + c]) - static_cast<int>(m.zeros[g])) * m.scales[g];
}
// int4's and W4A8's lane scales and offsets [P][G][64], offset = -zero * scale.
void pack_int4_lane(PackedWeights& p, int64_t panel, int lane, const QuantizedMatrix& m, int64_t row);
// data u8 [P][cols][64]: a panel's codes k by k, a lane's byte each (int8, fp8).
void pack_codes_by_k(PackedWeights& p, int64_t panel, const PanelLanes& lanes);
// Scales and offsets per K group, [P][G][64]: element (panel, g, lane).
inline int64_t group_index(const PackedWeights& p, int64_t panel, int64_t g, int lane) {
  return (panel * ((p.cols + p.group - 1) / p.group) + g) * kPanel + lane;
}

}  // namespace format_util

}  // namespace moex::kernels
