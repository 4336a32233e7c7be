// int8-w8a8: s8 codes and scales as int8 (quantize_int8); activations quantized per token to s8 (scale = absmax /
// 127), integer sums through vpdpbusd (u8 = q + 128, the col_sums undo the 128), both scales applied to the sum.
// Packed: data s8 [P][k_padded/4][64][4]; scales [P][64]; col_sums i32 [P][64] (sum over k of q); k_padded a
// multiple of 64, one AMX A tile row of u8.
#include <cstring>

#include "moex/kernels/formats/format.h"
#include "moex/kernels/x86/packed_x86.h"

namespace moex::kernels {
namespace {

using namespace format_util;

QuantizedMatrix quantize_hook(const TensorView& w, int64_t, bool) { return quantize_int8(w, WeightFormat::kInt8W8A8); }

void pack_lane(PackedWeights& p, int64_t panel, int lane, const QuantizedMatrix& m, int64_t row) {
  int32_t sum = 0;
  for (int64_t k = 0; k < m.cols; ++k) sum += static_cast<int8_t>(m.codes[row * m.cols + k]);
  p.scales.as<float>()[panel * kPanel + lane] = m.scales[row];
  p.col_sums.as<int32_t>()[panel * kPanel + lane] = sum;
}

void pack_panel(PackedWeights& p, int64_t panel, const PanelLanes& l) {  // [P][kp/4][64][4]
  const int64_t K = p.cols, kp = p.k_padded;
  uint8_t* out = p.data.as<uint8_t>() + panel * (kp / 4) * kPanel * 4;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4)
    for (int i = 0; i < l.n; ++i) std::memcpy(out + ((k / 4) * kPanel + l.lane[i]) * 4, l.codes[l.lane[i]] + k, 4);
  for (; k < K; ++k)
    for (int i = 0; i < l.n; ++i) out[((k / 4) * kPanel + l.lane[i]) * 4 + k % 4] = l.codes[l.lane[i]][k];
}

float packed_weight(const PackedWeights& w, int64_t panel, int lane, int64_t k) {  // the integer code
  return static_cast<float>(w.data.as<const int8_t>()[((panel * (w.k_padded / 4) + k / 4) * kPanel + lane) * 4 + k % 4]);
}

// The VNNI GEMM from 12 rows; on AMX tiles from 4 (docs/kernels.md "Crossovers"). Integer sums: every loop the same bits.
using L = ActivationLayout;
constexpr IsaKernels kKernels[] = {
    {Isa::kAvx2, L::kS8PerToken, x86::run_panels_w8a8_avx2},
    {Isa::kAvx512Vnni, L::kU8PerToken, x86::run_panels_w8a8_avx512vnni, x86::run_panels_w8a8_many_avx512vnni, 12, true},
    {Isa::kAmx, L::kU8PerToken, x86::run_panels_w8a8_avx512vnni, x86::run_panels_w8a8_amx, 4, true},
};

}  // namespace

constinit const FormatDef format_int8_w8a8 = {
    // format                name         buffers                                        k_mult bits k_padded grouped
    {WeightFormat::kInt8W8A8, "int8-w8a8", kDataBuffer | kScalesBuffer | kColSumsBuffer, 64,    8,   true,    false,
     // fixed_group activations                agree
     0,          ActivationKind::kS8PerToken, true, ""},
    quantize_hook, s8_per_row_weight, pack_lane, pack_panel, packed_weight, kKernels};

}  // namespace moex::kernels
