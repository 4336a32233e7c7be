// int8 (weight-only): s8 codes, w = q * scale[row] (symmetric per row, scale = absmax / 127); f32 activations, so a
// decode reads half of bf16's bytes. Its VNNI loop reads the activations as s16 codes per 128-k group, its AMX tiles
// as bf16 (hi, lo) planes, both within the f32 path's tolerance. Packed: data s8 [P][cols][64]; scales [P][64].
#include <algorithm>

#include "moex/base/error.h"
#include "moex/kernels/formats/format.h"
#include "moex/kernels/x86/packed_x86.h"

namespace moex::kernels {
namespace {

using namespace format_util;

QuantizedMatrix quantize_hook(const TensorView& w, int64_t, bool) { return quantize_int8(w, WeightFormat::kInt8); }

void pack_lane(PackedWeights& p, int64_t panel, int lane, const QuantizedMatrix& m, int64_t row) {
  p.scales.as<float>()[panel * kPanel + lane] = m.scales[row];
}

float packed_weight(const PackedWeights& w, int64_t panel, int lane, int64_t k) {
  return static_cast<float>(w.data.as<const int8_t>()[(panel * w.cols + k) * kPanel + lane]) *
         w.scales.as<const float>()[panel * kPanel + lane];
}

// Crossovers (docs/kernels.md): the s16-code VNNI loop keeps its few-row loop up to 32; AMX tiles (split planes) for
// any row count, its many-row loop from 5. x read as it is by the shared f32-FMA kernels.
using L = ActivationLayout;
constexpr IsaKernels kKernels[] = {
    weight_only_avx2(L::kF32), weight_only_avx512(L::kF32),
    {Isa::kAvx512Vnni, L::kS16Codes128, x86::run_panels_int8_avx512vnni, x86::run_panels_int8_avx512vnni, 32, true},
    {Isa::kAmx, L::kBf16SplitPlanes, x86::run_panels_int8_amx, x86::run_panels_int8_amx, 5, false},
};

}  // namespace

QuantizedMatrix quantize_int8(const TensorView& w, WeightFormat format) {
  check_source(w, "quantize_int8");
  MOEX_CHECK(format == WeightFormat::kInt8 || format == WeightFormat::kInt8W8A8);
  QuantizedMatrix q = empty_matrix(format, w.shape[0], w.shape[1]);
  q.codes.resize(q.rows * q.cols);  // [rows, cols] s8
  q.scales.resize(q.rows);          // [rows]
  for_each_index(q.rows, [&](int64_t r) {
    thread_local std::vector<float> buffer;
    const float* x = source_row(w, r, buffer);
    const float absmax = abs_max(x, q.cols);
    const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
    q.scales[r] = absmax / 127.0f;
    // std::clamp(v, -127, 127) written as min / max, and a restrict pointer (a byte store may alias anything, q.cols
    // included), so the loop vectorizes.
    const int64_t cols = q.cols;
    uint8_t* __restrict out = q.codes.data() + r * cols;
    for (int64_t c = 0; c < cols; ++c)
      out[c] = static_cast<uint8_t>(static_cast<int8_t>(std::min(std::max(round_even(x[c] * inv), -127.0f), 127.0f)));
  });
  return q;
}

constinit const FormatDef format_int8 = {
    // format            name    buffers                      k_mult bits k_padded grouped fixed_group activations         agree
    {WeightFormat::kInt8, "int8", kDataBuffer | kScalesBuffer, 1,     8,   false,   false,  0,          ActivationKind::kF32, false, ""},
    quantize_hook, s8_per_row_weight, pack_lane, pack_codes_by_k, packed_weight, kKernels};

}  // namespace moex::kernels
