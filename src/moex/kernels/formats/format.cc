// The helpers several formats' quantizers share (formats/format.h).
#include "moex/kernels/formats/format.h"

#include <algorithm>
#include <cmath>

#include "moex/base/dtype.h"
#include "moex/base/error.h"
#include "moex/base/threads.h"

namespace moex::kernels::format_util {

void check_source(const TensorView& w, const char* what) {
  MOEX_CHECK_INPUT(w.shape.rank == 2 && (w.dtype == DType::kF32 || w.dtype == DType::kBF16), what,
                   ": expected an F32 or BF16 matrix, got ", dtype_name(w.dtype), " ", w.shape.str());
}

const float* source_row(const TensorView& w, int64_t r, std::vector<float>& buffer) {
  const int64_t cols = w.shape[1];
  if (w.dtype == DType::kF32) return w.as<const float>() + r * w.stride0();
  buffer.resize(cols);
  const uint16_t* in = w.as<const uint16_t>() + r * w.stride0();
  for (int64_t c = 0; c < cols; ++c) buffer[c] = bf16_to_f32(in[c]);
  return buffer.data();
}

float abs_max(const float* x, int64_t n) {
  float part[16] = {};
  int64_t c = 0;
  for (; c + 16 <= n; c += 16)
    for (int j = 0; j < 16; ++j) part[j] = std::max(part[j], std::fabs(x[c + j]));
  for (; c < n; ++c) part[0] = std::max(part[0], std::fabs(x[c]));
  float m = 0.0f;
  for (float v : part) m = std::max(m, v);
  return m;
}

QuantizedMatrix empty_matrix(WeightFormat format, int64_t rows, int64_t cols, int64_t group) {
  QuantizedMatrix q;
  q.format = format;
  q.rows = rows;
  q.cols = cols;
  q.group = group;
  return q;
}

void for_each_index(int64_t n, const std::function<void(int64_t)>& fn) {
  parallel_for(n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(i);
  });
}

}  // namespace moex::kernels::format_util

namespace moex::kernels::format_util {

void pack_codes_by_k(PackedWeights& p, int64_t panel, const PanelLanes& l) {
  const int64_t K = p.cols;
  uint8_t* out = p.data.as<uint8_t>() + panel * K * kPanel;
  for (int64_t k = 0; k < K; ++k)
    for (int i = 0; i < l.n; ++i) out[k * kPanel + l.lane[i]] = l.codes[l.lane[i]][k];
}

}  // namespace moex::kernels::format_util

namespace moex::kernels::format_util {

void pack_int4_lane(PackedWeights& p, int64_t panel, int lane, const QuantizedMatrix& m, int64_t row) {
  const int64_t G = m.groups();
  for (int64_t g = 0; g < G; ++g) {
    const float scale = m.scales[row * G + g];
    p.scales.as<float>()[(panel * G + g) * kPanel + lane] = scale;
    p.offsets.as<float>()[(panel * G + g) * kPanel + lane] = -static_cast<float>(m.zeros[row * G + g]) * scale;
  }
}

}  // namespace moex::kernels::format_util
