// fp8-e4m3: e4m3 codes, w = fp8 * scale per 128x128 block (DeepSeek-V3's weight_scale_inv layout); activations
// rounded to bf16 (as int4) so vdpbf16ps can read the codes through a byte table. Packed: data u8 [P][cols][64];
// scales [P][G=ceil(cols/128)][64], times 2^8 (the kernels read an e4m3 code as fp16 bits, or as a bf16 table
// entry, both 2^-8 of its value); k_padded = round_up(cols, 2), the length of the bf16 activation rows (k pairs).
#include <algorithm>

#include "moex/base/cpu.h"
#include "moex/base/dtype.h"
#include "moex/base/error.h"
#include "moex/kernels/formats/format.h"
#include "moex/kernels/x86/packed_x86.h"

namespace moex::kernels {
namespace {

using namespace format_util;

QuantizedMatrix quantize_hook(const TensorView& w, int64_t, bool) { return quantize_fp8(w); }

float weight(const QuantizedMatrix& m, int64_t r, int64_t c) {
  return f8e4m3_to_f32(m.codes[r * m.cols + c]) * m.scales[(r / 128) * m.groups() + c / 128];
}

void pack_lane(PackedWeights& p, int64_t panel, int lane, const QuantizedMatrix& m, int64_t row) {
  const int64_t G = m.groups();
  for (int64_t g = 0; g < G; ++g)
    p.scales.as<float>()[(panel * G + g) * kPanel + lane] = m.scales[(row / 128) * G + g] * 256.0f;
}

float packed_weight(const PackedWeights& w, int64_t panel, int lane, int64_t k) {
  return f8e4m3_to_f32(w.data.as<const uint8_t>()[(panel * w.cols + k) * kPanel + lane]) *
         (w.scales.as<const float>()[group_index(w, panel, k / 128, lane)] / 256.0f);
}

// Crossovers (docs/kernels.md): the vdpbf16ps many-row loop decodes inside its first token tile and wins from 5; AMX
// tiles from 5. Every kernel reads bf16 values (the shared f32-FMA ones as f32).
using L = ActivationLayout;
constexpr IsaKernels kKernels[] = {
    weight_only_avx2(L::kF32RoundedBf16), weight_only_avx512(L::kF32RoundedBf16),
    {Isa::kAvx512Bf16, L::kBf16, x86::run_panels_fp8_avx512bf16vbmi, x86::run_panels_fp8_avx512bf16vbmi, 5, true},
    {Isa::kAmx, L::kBf16, x86::run_panels_fp8_avx512bf16vbmi, x86::run_panels_fp8_amx, 5, false},
};

}  // namespace

QuantizedMatrix quantize_fp8(const TensorView& w) {
  check_source(w, "quantize_fp8");
  QuantizedMatrix q = empty_matrix(WeightFormat::kFP8E4M3, w.shape[0], w.shape[1], 128);
  const int64_t row_blocks = (q.rows + 127) / 128, groups = q.groups();
  q.codes.resize(q.rows * q.cols);          // [rows, cols] e4m3
  q.scales.resize(row_blocks * groups);     // [ceil(rows/128), ceil(cols/128)]
  const int64_t cols = q.cols;
  for_each_index(row_blocks, [&](int64_t rb) {
    const int64_t r0 = rb * 128, r1 = std::min(q.rows, r0 + 128);
    thread_local std::vector<float> block;  // [r1 - r0][cols]: the block's rows widened once
    thread_local std::vector<float> buffer;
    block.resize((r1 - r0) * cols);
    for (int64_t r = r0; r < r1; ++r) std::copy_n(source_row(w, r, buffer), cols, block.data() + (r - r0) * cols);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * 128, n = std::min(cols, c0 + 128) - c0;
      float absmax = 0.0f;  // NaNs skipped, as abs_max does
      for (int64_t r = r0; r < r1; ++r) absmax = std::max(absmax, abs_max(block.data() + (r - r0) * cols + c0, n));
      const float scale = absmax / kF8E4M3Max;
      q.scales[rb * groups + g] = scale;
      for (int64_t r = r0; r < r1; ++r) {
        const float* __restrict x = block.data() + (r - r0) * cols + c0;
        uint8_t* __restrict out = q.codes.data() + r * cols + c0;  // restrict: a byte store may alias anything
        if (scale > 0.0f && use_x86_kernels()) {
          x86::f32_to_f8e4m3_row_avx512(x, n, scale, out);
        } else if (scale > 0.0f) {
          for (int64_t c = 0; c < n; ++c) out[c] = f32_to_f8e4m3(x[c] / scale);
        } else {
          std::fill_n(out, n, f32_to_f8e4m3(0.0f));  // an all-zero block
        }
      }
    }
  });
  return q;
}

QuantizedMatrix fp8_from_checkpoint(const TensorView& codes, const TensorView& scale_inv) {
  MOEX_CHECK_INPUT(codes.shape.rank == 2 && codes.dtype == DType::kF8E4M3, "fp8 weight: expected F8_E4M3 [rows, cols], got ",
                   dtype_name(codes.dtype), " ", codes.shape.str());
  QuantizedMatrix q = empty_matrix(WeightFormat::kFP8E4M3, codes.shape[0], codes.shape[1], 128);
  const int64_t row_blocks = (q.rows + 127) / 128, groups = q.groups();
  MOEX_CHECK_INPUT(scale_inv.dtype == DType::kF32 && scale_inv.shape == (Shape{row_blocks, groups}),
                   "fp8 weight_scale_inv: expected F32 ", Shape{row_blocks, groups}.str(), " (one per 128x128 block of ",
                   codes.shape.str(), "), got ", dtype_name(scale_inv.dtype), " ", scale_inv.shape.str());
  q.codes.resize(q.rows * q.cols);
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t c = 0; c < q.cols; ++c) q.codes[r * q.cols + c] = codes.as<const uint8_t>()[r * codes.stride0() + c];
  q.scales.resize(row_blocks * groups);
  for (int64_t rb = 0; rb < row_blocks; ++rb)
    for (int64_t g = 0; g < groups; ++g) q.scales[rb * groups + g] = scale_inv.as<const float>()[rb * scale_inv.stride0() + g];
  return q;
}

constinit const FormatDef format_fp8_e4m3 = {
    // format                name        buffers                      k_mult bits k_padded grouped fixed_group
    {WeightFormat::kFP8E4M3, "fp8-e4m3", kDataBuffer | kScalesBuffer, 2,     8,   false,   true,   128,
     // activations       agree  alias
     ActivationKind::kBf16, false, "fp8"},
    quantize_hook, weight, pack_lane, pack_codes_by_k, packed_weight, kKernels};

}  // namespace moex::kernels
