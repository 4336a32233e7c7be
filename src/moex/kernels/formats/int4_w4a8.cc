// int4-w4a8: int4 codes, scales and zeros as int4 (quantize_int4); activations quantized to s8 per token and K group
// (the weights' groups, each with its own absmax / 127 scale), and vpdpbusd multiplies the codes (u8 0..15) by them:
// four products per instruction, not two. Packed: data u8 [P][k_padded/8][64][4] (a lane's 32 bits hold 8 k: byte
// b has q(8j+b) low, q(8j+4+b) high, so masking gives the k quad 8j.. and a shift the quad 8j+4..); scales, offsets
// [P][G][64] as int4.
#include "moex/kernels/formats/format.h"
#include "moex/kernels/x86/packed_x86.h"

namespace moex::kernels {
namespace {

using namespace format_util;

QuantizedMatrix quantize_hook(const TensorView& w, int64_t group, bool symmetric) {
  return quantize_int4(w, group, symmetric, WeightFormat::kInt4W4A8);
}

void pack_panel(PackedWeights& p, int64_t panel, const PanelLanes& l) {  // byte k % 4 of the lane's word, low nibble for k % 8 < 4
  const int64_t K = p.cols, kp = p.k_padded;
  uint8_t* out = p.data.as<uint8_t>() + panel * (kp / 8) * kPanel * 4;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8)
    for (int i = 0; i < l.n; ++i) {
      const uint8_t* c = l.codes[l.lane[i]] + k;
      uint8_t* o = out + ((k / 8) * kPanel + l.lane[i]) * 4;
      for (int j = 0; j < 4; ++j) o[j] = static_cast<uint8_t>(c[j] | (c[j + 4] << 4));
    }
  for (; k < K; ++k)
    for (int i = 0; i < l.n; ++i)
      out[((k / 8) * kPanel + l.lane[i]) * 4 + k % 4] |= static_cast<uint8_t>(l.codes[l.lane[i]][k] << (k % 8 < 4 ? 0 : 4));
}

float packed_weight(const PackedWeights& w, int64_t panel, int lane, int64_t k) {
  const uint8_t byte = w.data.as<const uint8_t>()[((panel * (w.k_padded / 8) + k / 8) * kPanel + lane) * 4 + k % 4];
  const int64_t s = group_index(w, panel, k / w.group, lane);
  return static_cast<float>(k % 8 < 4 ? byte & 15 : byte >> 4) * w.scales.as<const float>()[s] + w.offsets.as<const float>()[s];
}

// AVX2's and the VNNI kernel have one loop for every row count; AMX tiles from 6 rows, folded as the VNNI loop folds
// (the same bits).
using L = ActivationLayout;
constexpr IsaKernels kKernels[] = {
    {Isa::kAvx2, L::kS8PerGroupSums, x86::run_panels_int4_w4a8_avx2},
    {Isa::kAvx512Vnni, L::kS8PerGroupSumsAvx512, x86::run_panels_int4_w4a8_avx512vnni},
    {Isa::kAmx, L::kS8PerGroupSumsAvx512, x86::run_panels_int4_w4a8_avx512vnni, x86::run_panels_int4_w4a8_amx, 6, true},
};

}  // namespace

constinit const FormatDef format_int4_w4a8 = {
    // format                name         buffers                                       k_mult bits k_padded grouped
    {WeightFormat::kInt4W4A8, "int4-w4a8", kDataBuffer | kScalesBuffer | kOffsetsBuffer, 8,     4,   true,    true,
     // fixed_group activations                agree
     0,          ActivationKind::kS8PerGroup, true, ""},
    quantize_hook, int4_grouped_weight, pack_int4_lane, pack_panel, packed_weight, kKernels};

}  // namespace moex::kernels
