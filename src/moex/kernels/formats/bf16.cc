// bf16: weights rounded to bf16, activations rounded to bf16 per call, vdpbf16ps (f32 accumulation); AMX tiles above.
// Packed: data u16 [P][k_padded/2][64][2] (VNNI pairs: a 32-bit lane holds W[n][k], W[n][k+1]), k_padded a multiple
// of 32 (AMX's A tile is 32 k wide), so B tiles (16 pairs) never run past a panel.
#include <cstring>

#include "moex/base/dtype.h"
#include "moex/base/error.h"
#include "moex/kernels/formats/format.h"
#include "moex/kernels/x86/packed_x86.h"

namespace moex::kernels {
namespace {

using namespace format_util;

QuantizedMatrix quantize_hook(const TensorView& w, int64_t, bool) { return quantize_bf16(w); }

float weight(const QuantizedMatrix& m, int64_t r, int64_t c) { return bf16_to_f32(m.bf16[r * m.cols + c]); }

void pack_panel(PackedWeights& p, int64_t panel, const PanelLanes& l) {  // [P][kp/2][64][2]
  const int64_t K = p.cols, kp = p.k_padded;
  uint16_t* out = p.data.as<uint16_t>() + panel * (kp / 2) * kPanel * 2;
  int64_t k = 0;
  for (; k + 2 <= K; k += 2)
    for (int i = 0; i < l.n; ++i) {
      uint16_t* o = out + ((k / 2) * kPanel + l.lane[i]) * 2;
      o[0] = l.bf16[l.lane[i]][k];
      o[1] = l.bf16[l.lane[i]][k + 1];
    }
  if (k < K)
    for (int i = 0; i < l.n; ++i) out[((k / 2) * kPanel + l.lane[i]) * 2] = l.bf16[l.lane[i]][k];
}

float packed_weight(const PackedWeights& w, int64_t panel, int lane, int64_t k) {
  return bf16_to_f32(w.data.as<const uint16_t>()[((panel * (w.k_padded / 2) + k / 2) * kPanel + lane) * 2 + k % 2]);
}

// The many-row GEMM from 12 rows on AVX512-BF16; tdpbf16ps sums a k pair in another order than vdpbf16ps, so AMX
// runs tiles for every row count (from 1): one loop (docs/kernels.md "Crossovers").
using L = ActivationLayout;
constexpr IsaKernels kKernels[] = {
    weight_only_avx2(L::kF32RoundedBf16),
    {Isa::kAvx512Bf16, L::kBf16, x86::run_panels_bf16_avx512bf16, x86::run_panels_bf16_many_avx512bf16, 12, true},
    {Isa::kAmx, L::kBf16, x86::run_panels_bf16_avx512bf16, x86::run_panels_bf16_amx, 1, true},
};

}  // namespace

void pack_bf16_panel(const TensorView& a, const TensorView* b, const PackedWeights& p, int64_t panel) {
  constexpr int kLanes = kPanel;
  const int64_t K = p.cols, pairs = p.k_padded / 2, full = K / 2;
  uint32_t* out = p.data.as<uint32_t>() + panel * pairs * kLanes;
  const void* src[kLanes];
  bool any_missing = false;
  for (int lane = 0; lane < kLanes; ++lane) {
    const int64_t row = p.gate_up ? panel * (kLanes / 2) + lane % (kLanes / 2) : panel * kLanes + lane;
    const TensorView& m = p.gate_up && lane >= kLanes / 2 ? *b : a;
    src[lane] = row < p.rows ? static_cast<const char*>(m.data) + row * m.stride0() * dtype_size(m.dtype) : nullptr;
    any_missing |= src[lane] == nullptr;
  }
  const auto pair_at = [&](int lane, int64_t k) -> uint32_t {  // W[n][k], W[n][k+1] (zero past K)
    if (!src[lane] || k >= K) return 0;
    uint16_t lo, hi = 0;
    if (a.dtype == DType::kBF16) {
      const auto* r = static_cast<const uint16_t*>(src[lane]);
      lo = r[k];
      if (k + 1 < K) hi = r[k + 1];
    } else {
      const auto* r = static_cast<const float*>(src[lane]);
      lo = f32_to_bf16(r[k]);
      if (k + 1 < K) hi = f32_to_bf16(r[k + 1]);
    }
    return uint32_t{lo} | (uint32_t{hi} << 16);
  };
  if (a.dtype == DType::kBF16 && !any_missing) {  // the common case: 64 rows of bf16 pairs, 32-bit words as they are
    for (int64_t j = 0; j < full; ++j) {
      uint32_t* o = out + j * kLanes;
      for (int lane = 0; lane < kLanes; ++lane) std::memcpy(o + lane, static_cast<const uint16_t*>(src[lane]) + 2 * j, 4);
    }
  } else {
    for (int64_t j = 0; j < full; ++j)
      for (int lane = 0; lane < kLanes; ++lane) out[j * kLanes + lane] = pair_at(lane, 2 * j);
  }
  for (int64_t j = full; j < pairs; ++j)
    for (int lane = 0; lane < kLanes; ++lane) out[j * kLanes + lane] = pair_at(lane, 2 * j);
}


QuantizedMatrix quantize_bf16(const TensorView& w) {
  check_source(w, "quantize_bf16");
  QuantizedMatrix q = empty_matrix(WeightFormat::kBF16, w.shape[0], w.shape[1]);
  q.bf16.resize(q.rows * q.cols);  // [rows, cols]
  for_each_index(q.rows, [&](int64_t r) {
    thread_local std::vector<float> buffer;
    const float* x = source_row(w, r, buffer);
    const int64_t cols = q.cols;
    uint16_t* __restrict out = q.bf16.data() + r * cols;
    for (int64_t c = 0; c < cols; ++c) out[c] = f32_to_bf16(x[c]);
  });
  return q;
}

constinit const FormatDef format_bf16 = {
    // format            name    buffers      k_mult bits k_padded grouped fixed_group activations          agree
    {WeightFormat::kBF16, "bf16", kDataBuffer, 32,    16,  true,    false,  0,          ActivationKind::kBf16, true, ""},
    quantize_hook, weight, nullptr, pack_panel, packed_weight, kKernels};

}  // namespace moex::kernels
