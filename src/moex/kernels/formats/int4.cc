// int4 (weight-only): q in 0..15, w = (q - zero) * scale per row and group of `group` (--group-size: 32, 64, 128)
// along K, two codes per packed byte; activations rounded to bf16 (far below int4's own error) so vdpbf16ps can
// read the codes. Packed: data u8 [P][k_padded/2][64] (a lane's byte: q(k) low nibble, q(k+1) high); scales,
// offsets [P][G][64] with w = q * scale + offset (offset = -zero * scale).
#include <algorithm>

#include "moex/base/error.h"
#include "moex/kernels/formats/format.h"
#include "moex/kernels/x86/packed_x86.h"

namespace moex::kernels {
namespace {

using namespace format_util;

QuantizedMatrix quantize_hook(const TensorView& w, int64_t group, bool symmetric) {
  return quantize_int4(w, group, symmetric, WeightFormat::kInt4);
}

void pack_panel(PackedWeights& p, int64_t panel, const PanelLanes& l) {  // [P][kp/2][64]
  const int64_t K = p.cols, kp = p.k_padded;
  uint8_t* out = p.data.as<uint8_t>() + panel * (kp / 2) * kPanel;
  int64_t k = 0;
  for (; k + 2 <= K; k += 2)
    for (int i = 0; i < l.n; ++i) {
      const uint8_t* c = l.codes[l.lane[i]] + k;
      out[(k / 2) * kPanel + l.lane[i]] = static_cast<uint8_t>(c[0] | (c[1] << 4));
    }
  if (k < K)
    for (int i = 0; i < l.n; ++i) out[(k / 2) * kPanel + l.lane[i]] = l.codes[l.lane[i]][k];
}

float packed_weight(const PackedWeights& w, int64_t panel, int lane, int64_t k) {
  const uint8_t byte = w.data.as<const uint8_t>()[(panel * (w.k_padded / 2) + k / 2) * kPanel + lane];
  const int64_t s = group_index(w, panel, k / w.group, lane);
  return static_cast<float>(k % 2 ? byte >> 4 : byte & 15) * w.scales.as<const float>()[s] + w.offsets.as<const float>()[s];
}

// Crossovers (docs/kernels.md): the vdpbf16ps decoded-block loop from 16 rows; on AMX tiles from 3. The AVX2 and
// vdpbf16ps kernels fold offset * (sum of x) per K group: their layouts carry the sums.
using L = ActivationLayout;
constexpr IsaKernels kKernels[] = {
    weight_only_avx2(L::kF32RoundedBf16Sums), weight_only_avx512(L::kF32RoundedBf16),
    {Isa::kAvx512Bf16, L::kBf16Sums, x86::run_panels_int4_avx512bf16vbmi, x86::run_panels_int4_avx512bf16vbmi, 16, true},
    {Isa::kAmx, L::kBf16Sums, x86::run_panels_int4_avx512bf16vbmi, x86::run_panels_int4_amx, 3, false},
};

}  // namespace

QuantizedMatrix quantize_int4(const TensorView& w, int64_t group, bool symmetric, WeightFormat format) {
  check_source(w, "quantize_int4");
  MOEX_CHECK(format == WeightFormat::kInt4 || format == WeightFormat::kInt4W4A8);
  MOEX_CHECK_INPUT(group == 32 || group == 64 || group == 128, "int4 group size ", group, " (use 32, 64 or 128)");
  QuantizedMatrix q = empty_matrix(format, w.shape[0], w.shape[1], group);
  const int64_t groups = q.groups();
  q.codes.resize(q.rows * q.cols);  // [rows, cols] 0..15
  q.scales.resize(q.rows * groups);  // [rows, groups]
  q.zeros.resize(q.rows * groups);   // [rows, groups]
  const int64_t cols = q.cols;
  for_each_index(q.rows, [&](int64_t r) {
    thread_local std::vector<float> buffer;
    const float* x = source_row(w, r, buffer);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * group, c1 = std::min(cols, c0 + group);
      // The range includes 0, so 0 is exact and a constant group is not lost. 8 independent minima and maxima
      // (NaNs skipped, as one std::min / std::max chain from 0 does), so the loop is not one dependency chain.
      float lo8[8] = {}, hi8[8] = {};
      int64_t c = c0;
      for (; c + 8 <= c1; c += 8)
        for (int j = 0; j < 8; ++j) lo8[j] = std::min(lo8[j], x[c + j]), hi8[j] = std::max(hi8[j], x[c + j]);
      for (; c < c1; ++c) lo8[0] = std::min(lo8[0], x[c]), hi8[0] = std::max(hi8[0], x[c]);
      float lo = 0.0f, hi = 0.0f;
      for (int j = 0; j < 8; ++j) lo = std::min(lo, lo8[j]), hi = std::max(hi, hi8[j]);
      float scale;
      int zero;
      if (symmetric) {
        scale = std::max(-lo, hi) / 7.0f;
        zero = 8;
      } else {
        scale = (hi - lo) / 15.0f;
        zero = scale > 0.0f ? static_cast<int>(std::clamp(round_even(-lo / scale), 0.0f, 15.0f)) : 0;
      }
      q.scales[r * groups + g] = scale;
      q.zeros[r * groups + g] = static_cast<uint8_t>(zero);
      const float fzero = static_cast<float>(zero);
      uint8_t* __restrict out = q.codes.data() + r * cols;  // restrict: a byte store may alias anything
      if (scale > 0.0f) {
        for (int64_t c = c0; c < c1; ++c)  // std::clamp(v, 0, 15) as min / max, so the loop vectorizes
          out[c] = static_cast<uint8_t>(std::min(std::max(round_even(x[c] / scale) + fzero, 0.0f), 15.0f));
      } else {
        for (int64_t c = c0; c < c1; ++c) out[c] = static_cast<uint8_t>(std::clamp(fzero, 0.0f, 15.0f));
      }
    }
  });
  return q;
}

constinit const FormatDef format_int4 = {
    // format            name    buffers                                       k_mult bits k_padded grouped
    {WeightFormat::kInt4, "int4", kDataBuffer | kScalesBuffer | kOffsetsBuffer, 2,     4,   true,    true,
     // fixed_group activations           agree
     0,          ActivationKind::kBf16, false, ""},
    quantize_hook, int4_grouped_weight, pack_int4_lane, pack_panel, packed_weight, kKernels};

}  // namespace moex::kernels
