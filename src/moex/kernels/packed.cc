// The format-independent half of packing and the dispatch: the one-time repack into panels (each format's
// hooks, kernels/formats/<name>.cc, write its lanes and panels), checks, activation conversion, threads split the
// panels, each ISA's kernel runs its share (kernels/x86/packed_*), or the scalar loop over the same packed layout
// when the CPU (or MOEX_ISA=ref) rules the x86 kernels out.
#include "moex/kernels/packed.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string_view>
#include <vector>


#include <omp.h>

#include "moex/base/dtype.h"
#include "moex/base/error.h"
#include "moex/base/system_memory.h"
#include "moex/base/threads.h"
#include "moex/kernels/formats/format.h"
#include "moex/kernels/x86/packed_x86.h"

namespace moex::kernels {
namespace {

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace

float QuantizedMatrix::weight(int64_t r, int64_t c) const { return format_def(format).weight(*this, r, c); }

QuantizedMatrix quantize(const TensorView& w, WeightFormat format, int64_t group) {
  return format_def(format).quantize(w, group, /*symmetric=*/true);
}

QuantizedMatrix quantize(const TensorView& w, WeightFormat format, int64_t group, bool symmetric) {
  return format_def(format).quantize(w, group, symmetric);
}

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

std::shared_ptr<uint8_t> allocate_zeroed(size_t bytes, size_t alignment) {
  std::shared_ptr<uint8_t> p(static_cast<uint8_t*>(std::aligned_alloc(alignment, bytes)), [](uint8_t* q) { std::free(q); });
  MOEX_CHECK(p, "out of memory packing ", bytes, " bytes of weights");
  if (bytes < 2 * kHugePage) {
    std::fill_n(p.get(), bytes, uint8_t{0});
    return p;
  }
  advise_huge_pages(p.get(), bytes);
  // A layer's arena (188 MB of mini's bf16 experts) is first touched here: the page faults (the kernel zeroing
  // each huge page, on this VM at 0.5-2 GB/s from one thread) are most of a load's time, so the threads take
  // huge pages in turn.
  parallel_for(static_cast<int64_t>((bytes + kHugePage - 1) / kHugePage), 1, [&](int64_t begin, int64_t end) {
    const size_t from = static_cast<size_t>(begin) * kHugePage, to = std::min(bytes, static_cast<size_t>(end) * kHugePage);
    std::fill(p.get() + from, p.get() + to, uint8_t{0});
  });
  return p;
}

size_t round_up_64(size_t bytes) { return std::max<size_t>(64, (bytes + 63) / 64 * 64); }

}  // namespace

void AlignedBytes::allocate(size_t bytes) {
  size = bytes;
  ptr = allocate_zeroed(round_up_64(bytes), 64);
}

size_t WeightArena::bytes_for(const PackedWeights& w) {
  size_t total = 0;
  for (const AlignedBytes* b : {&w.data, &w.scales, &w.offsets, &w.col_sums})
    if (b->ptr) total += round_up_64(b->size);
  return total;
}

void WeightArena::reserve(size_t bytes) {
  MOEX_CHECK(!base_, "WeightArena::reserve: reserved already");
  capacity_ = (std::max<size_t>(bytes, 1) + kHugePage - 1) / kHugePage * kHugePage;
  base_ = allocate_zeroed(capacity_, kHugePage);
  used_ = 0;
}

bool WeightArena::adopt(PackedWeights& w) {
  if (!base_ || used_ + bytes_for(w) > capacity_) return false;
  for (AlignedBytes* b : {&w.data, &w.scales, &w.offsets, &w.col_sums}) {
    if (!b->ptr) continue;
    uint8_t* to = base_.get() + used_;
    std::copy_n(b->ptr.get(), b->size, to);
    b->ptr = std::shared_ptr<uint8_t>(base_, to);  // aliasing: the slice keeps the arena alive; the old buffer is freed
    used_ += round_up_64(b->size);
  }
  return true;
}

size_t PackedWeights::weight_bytes() const { return data.size + scales.size + offsets.size + col_sums.size; }

PackedWeights packed_layout(WeightFormat format, int64_t rows, int64_t cols, int64_t group, bool gate_up) {
  PackedWeights p;
  p.format = format;
  p.rows = rows;
  p.cols = cols;
  p.group = group;
  p.gate_up = gate_up;
  p.panels = (rows + p.rows_per_panel() - 1) / p.rows_per_panel();
  const FormatTraits& t = format_traits(format);
  const int64_t K = cols, P = p.panels, G = t.grouped ? (cols + group - 1) / group : 1;
  p.k_padded = round_up(K, t.k_multiple);
  const auto bytes = [](int64_t n) { return static_cast<size_t>(n); };
  p.data.size = bytes((t.data_spans_k_padded ? p.k_padded : K) * P * kPanel * t.code_bits / 8);
  if (PackedWeights::has_buffer(format, 1)) p.scales.size = bytes(P * G * kPanel * 4);
  if (PackedWeights::has_buffer(format, 2)) p.offsets.size = bytes(P * G * kPanel * 4);
  if (PackedWeights::has_buffer(format, 3)) p.col_sums.size = bytes(P * kPanel * 4);
  // MOEX_ROW_KERNEL is checked here, at load on the loading thread, where a bad value can throw (never inside a
  // parallel region).
  if (!omp_in_parallel()) validate_kernel_environment();
  p.kernel = choose_kernel(format);
  return p;
}

namespace {

struct LaneSource {
  const QuantizedMatrix* m = nullptr;  // nullptr: a padding lane (zero weight)
  int64_t row = 0;
};

// Fills every panel lane from the row `source` names. The packed layouts are those of PackedWeights.
PackedWeights pack_lanes(const QuantizedMatrix& like, int64_t rows, bool gate_up,
                         const std::function<LaneSource(int64_t panel, int lane)>& source) {
  PackedWeights p = packed_layout(like.format, rows, like.cols, like.group, gate_up);
  for (int b = 0; b < PackedWeights::kBuffers; ++b)  // zero-filled: padding lanes stay zero
    if (PackedWeights::has_buffer(p.format, b)) p.buffer(b).allocate(p.buffer(b).size);
  const FormatDef& def = format_def(p.format);
  const int64_t K = like.cols;
  // Per panel: the lanes' rows first, then the panel written in its own order (k outer, lanes inner), so the
  // writes run through the panel once and each lane's row is read along (64 read streams). Lanes with no row
  // (padding) stay zero, as allocate() filled them. Tails of K (a partial pair / quad / octet) go element by
  // element.
  format_util::for_each_index(p.panels, [&](int64_t panel) {
    PanelLanes lanes;
    for (int lane = 0; lane < kPanel; ++lane) {
      const LaneSource s = source(panel, lane);
      if (!s.m) continue;
      const QuantizedMatrix& m = *s.m;
      lanes.lane[lanes.n++] = lane;
      if (!m.bf16.empty()) lanes.bf16[lane] = m.bf16.data() + s.row * K;
      if (!m.codes.empty()) lanes.codes[lane] = m.codes.data() + s.row * K;
      if (def.pack_lane) def.pack_lane(p, panel, lane, m, s.row);
    }
    def.pack_panel(p, panel, lanes);
  });
  return p;
}

void check_quantized(const QuantizedMatrix& w) {
  MOEX_CHECK(w.rows >= 0 && w.cols >= 0);
  const size_t n = static_cast<size_t>(w.rows * w.cols);
  MOEX_CHECK(w.bf16.size() + w.codes.size() == n, "weight codes size");  // a format fills one of them
}

}  // namespace

PackedWeights pack(const QuantizedMatrix& w) {
  check_quantized(w);
  return pack_lanes(w, w.rows, false, [&](int64_t panel, int lane) {
    const int64_t row = panel * kPanel + lane;
    return row < w.rows ? LaneSource{&w, row} : LaneSource{};
  });
}

PackedWeights pack_gate_up(const QuantizedMatrix& w1, const QuantizedMatrix& w3) {
  check_quantized(w1);
  check_quantized(w3);
  MOEX_CHECK_INPUT(w1.format == w3.format && w1.rows == w3.rows && w1.cols == w3.cols && w1.group == w3.group,
                   "expert w1 and w3 differ in format or shape: ", weight_format_name(w1.format), " [", w1.rows, ", ",
                   w1.cols, "] vs ", weight_format_name(w3.format), " [", w3.rows, ", ", w3.cols, "]");
  return pack_lanes(w1, w1.rows, true, [&](int64_t panel, int lane) {
    const int64_t row = panel * (kPanel / 2) + lane % 32;
    return row < w1.rows ? LaneSource{lane < 32 ? &w1 : &w3, row} : LaneSource{};
  });
}

float quantize_activations_s8(const float* x, int64_t k, int8_t* q) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < k; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const float inv = absmax > 0.0f ? 127.0f / absmax : 0.0f;
  for (int64_t i = 0; i < k; ++i) q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] * inv), -127.0f, 127.0f));
  return absmax > 0.0f ? absmax / 127.0f : 0.0f;
}

namespace {

// The packed weight at (panel, lane, k), decoded: the scalar path's view of the layouts above.
float packed_weight(const PackedWeights& w, int64_t panel, int lane, int64_t k) {
  return format_def(w.format).packed_weight(w, panel, lane, k);
}

}  // namespace

// Shared by the scalar path and the AVX2 kernels (packed_x86.h).
namespace x86 {
void apply_epilogue_scalar(const Epilogue& e, const PackedWeights& w, int64_t panel, int64_t tokens, const float* c) {
  for (int64_t t = 0; t < tokens; ++t) {
    if (w.gate_up) {
      for (int64_t i = 0; i < kPanel / 2 && panel * 32 + i < w.rows; ++i) {
        const float g = c[t * kPanel + i];
        e.y[t * e.ld_y + panel * 32 + i] = g / (1.0f + std::exp(-g)) * c[t * kPanel + 32 + i];
      }
      continue;
    }
    float* row = e.kind == Epilogue::kRoutedAccumulate ? e.y + e.out_rows[t] * e.ld_y : e.y + t * e.ld_y;
    for (int64_t i = 0; i < kPanel && panel * kPanel + i < w.rows; ++i) {
      float& out = row[panel * kPanel + i];
      const float r = c[t * kPanel + i];
      switch (e.kind) {
        case Epilogue::kStore: out = r; break;
        case Epilogue::kAccumulate: out += r; break;
        case Epilogue::kRoutedAccumulate: out += e.route_weights[t] * r; break;
        case Epilogue::kSiluMul: break;
      }
    }
  }
}
}  // namespace x86

namespace {

// Threads take chunks of panels as they free up (a few chunks per thread) rather than one fixed share each:
// on a machine other processes load, a descheduled thread then delays its current chunk, not the whole
// call; a chunk is still a contiguous run of panels, so each thread streams.
template <typename Fn>
void for_panel_chunks(int64_t panels, Fn&& fn) {
  const int threads = num_threads();
  if (threads <= 1 || panels <= 1) {
    fn(int64_t{0}, panels);
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, panels / (threads * 4));
  const int64_t chunks = (panels + chunk - 1) / chunk;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < chunks; ++i) fn(i * chunk, std::min(panels, (i + 1) * chunk));
}

// W4A8's activations: row x [K] quantized one K group of `group` at a time (quantize_activations_s8 on each);
// q [K] the codes, scales [G] each group's scale.
void quantize_groups_s8(const float* x, int64_t K, int64_t group, int8_t* q, float* scales) {
  for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, ++g)
    scales[g] = quantize_activations_s8(x + k0, std::min(K, k0 + group) - k0, q + k0);
}

thread_local std::vector<float> g_act_f32;  // run_scalar: [T][K] x as the kernels round it
thread_local std::vector<float> g_token_scales;  // run_scalar: [T]

void run_scalar(const float* x, int64_t tokens, const PackedWeights& w, const x86::Epilogue& e) {
  const int64_t K = w.cols;
  // The kernels' rounding of the activations, so this path computes what they compute.
  std::vector<float>& xr = g_act_f32;
  xr.assign(x, x + tokens * K);  // [T][K]
  std::vector<float>& token_scales = g_token_scales;
  token_scales.assign(tokens, 1.0f);
  const ActivationKind kind = format_traits(w.format).activations;
  if (kind == ActivationKind::kBf16) {
    for (float& v : xr) v = bf16_to_f32(f32_to_bf16(v));
  } else if (kind == ActivationKind::kS8PerGroup) {  // codes times their group's scale
    std::vector<int8_t> q(K);
    std::vector<float> scales((K + w.group - 1) / w.group);
    for (int64_t t = 0; t < tokens; ++t) {
      quantize_groups_s8(x + t * K, K, w.group, q.data(), scales.data());
      for (int64_t k = 0; k < K; ++k) xr[t * K + k] = static_cast<float>(q[k]) * scales[k / w.group];
    }
  } else if (kind == ActivationKind::kS8PerToken) {
    std::vector<int8_t> q(K);
    for (int64_t t = 0; t < tokens; ++t) {
      token_scales[t] = quantize_activations_s8(x + t * K, K, q.data());
      for (int64_t k = 0; k < K; ++k) xr[t * K + k] = q[k];
    }
  }
  for_panel_chunks(w.panels, [&](int64_t begin, int64_t end) {
    std::vector<float> c(tokens * kPanel);  // [T][64]
    for (int64_t panel = begin; panel < end; ++panel) {
      for (int64_t t = 0; t < tokens; ++t) {
        for (int lane = 0; lane < kPanel; ++lane) {
          float sum = 0.0f;
          int64_t isum = 0;
          for (int64_t k = 0; k < K; ++k) {
            if (kind == ActivationKind::kS8PerToken)
              isum += static_cast<int64_t>(xr[t * K + k]) * static_cast<int64_t>(packed_weight(w, panel, lane, k));
            else
              sum += xr[t * K + k] * packed_weight(w, panel, lane, k);
          }
          if (kind == ActivationKind::kS8PerToken)
            sum = static_cast<float>(isum) * (token_scales[t] * w.scales.as<const float>()[panel * kPanel + lane]);
          c[t * kPanel + lane] = sum;
        }
      }
      x86::apply_epilogue_scalar(e, w, panel, tokens, c.data());
    }
  });
}

// Activations in the layout a kernel reads (ActivationLayout, named by its registry entry): converted row by row (so
// callers may split rows across threads, or convert the rows of several experts in one loop) and bound to a
// PanelJob from any first row. The buffers of several layouts may live in one (the few- and many-row loops of a
// weight may read different ones); each switch below has a case per layout and names no format.
struct Activations {
  std::vector<uint16_t> bf16;  // kBf16, kBf16Sums: [T][k_padded]; kBf16SplitPlanes: [T][split_row_stride(K)]
  std::vector<uint8_t> u8;     // kU8PerToken: [T][k_padded] q + 128; kS8PerToken, kS8PerGroupSums(Avx512): q's bytes
  std::vector<int16_t> s16;    // kS16Codes128: [T][int8_activation_stride(K)] (scales in extra)
  std::vector<float> f32;      // kF32RoundedBf16(Sums): [T][K]
  std::vector<float> extra;    // scales: kU8PerToken, kS8PerToken [T]; kS8PerGroupSums(Avx512) [T][groups];
                               // kS16Codes128 [T][int8_activation_groups(K)]; sums: kF32RoundedBf16Sums, kBf16Sums
                               // [T][groups]
  std::vector<float> code_sums;  // kS8PerGroupSums(Avx512): [T][groups] sums of the activation codes per K group

  static size_t groups_of(const PackedWeights& w) { return w.group ? (w.cols + w.group - 1) / w.group : 1; }
  template <typename T>
  static void at_least(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
  }

  void size_for(ActivationLayout layout, const PackedWeights& w, int64_t tokens) {
    const size_t T = tokens, kp = w.k_padded, K = w.cols, groups = groups_of(w);
    switch (layout) {
      case ActivationLayout::kF32: break;
      case ActivationLayout::kF32RoundedBf16Sums: at_least(extra, T * groups); [[fallthrough]];
      case ActivationLayout::kF32RoundedBf16: at_least(f32, T * K); break;
      case ActivationLayout::kBf16Sums: at_least(extra, T * groups); [[fallthrough]];
      case ActivationLayout::kBf16: at_least(bf16, T * kp); break;
      case ActivationLayout::kBf16SplitPlanes: at_least(bf16, T * x86::split_row_stride(w.cols)); break;
      case ActivationLayout::kS16Codes128:
        at_least(s16, T * x86::int8_activation_stride(w.cols));
        at_least(extra, T * x86::int8_activation_groups(w.cols));
        break;
      case ActivationLayout::kS8PerGroupSums:
      case ActivationLayout::kS8PerGroupSumsAvx512: at_least(code_sums, T * groups); [[fallthrough]];
      case ActivationLayout::kU8PerToken:
      case ActivationLayout::kS8PerToken:
        at_least(u8, T * kp);
        at_least(extra, T * groups);  // groups is 1 but for the per-group layouts
        break;
    }
  }
  // Row x [K] into row t.
  void convert(ActivationLayout layout, const PackedWeights& w, const float* x, int64_t t) {
    const int64_t K = w.cols, kp = w.k_padded;
    switch (layout) {
      case ActivationLayout::kF32: break;
      case ActivationLayout::kF32RoundedBf16:
      case ActivationLayout::kF32RoundedBf16Sums:
        for (int64_t k = 0; k < K; ++k) f32[t * K + k] = bf16_to_f32(f32_to_bf16(x[k]));
        if (layout == ActivationLayout::kF32RoundedBf16Sums) {  // int4 on AVX2: its kernel folds offset * sum(x)
          const int64_t groups = (K + w.group - 1) / w.group;
          for (int64_t g = 0; g < groups; ++g) {
            float sum = 0.0f;
            for (int64_t k = g * w.group; k < std::min(K, (g + 1) * w.group); ++k) sum += f32[t * K + k];
            extra[t * groups + g] = sum;
          }
        }
        break;
      case ActivationLayout::kBf16:
      case ActivationLayout::kBf16Sums: {
        uint16_t* row = bf16.data() + t * kp;
        x86::round_row_bf16_avx512bf16(x, K, kp, row);
        if (layout != ActivationLayout::kBf16Sums) break;
        // int4: the kernel multiplies the activations by q + 16 (the codes as bf16, a masked OR) and takes
        // (zero + 16) * scale * (sum of the group's activations) back off.
        const int64_t groups = (K + w.group - 1) / w.group;
        for (int64_t g = 0; g < groups; ++g) {
          float sum = 0.0f;
          for (int64_t k = g * w.group; k < std::min(K, (g + 1) * w.group); ++k) sum += bf16_to_f32(row[k]);
          extra[t * groups + g] = sum;
        }
        break;
      }
      case ActivationLayout::kBf16SplitPlanes: {
        uint16_t* row = bf16.data() + t * x86::split_row_stride(K);
        x86::split_row_bf16_avx512bf16(x, K, x86::split_plane(K), row, row + x86::split_plane(K));
        break;
      }
      case ActivationLayout::kS16Codes128:
        x86::quantize_row_s16_avx512(x, K, s16.data() + t * x86::int8_activation_stride(K),
                                     extra.data() + t * x86::int8_activation_groups(K));
        break;
      case ActivationLayout::kU8PerToken: extra[t] = x86::quantize_row_u8_avx512(x, K, kp, u8.data() + t * kp); break;
      case ActivationLayout::kS8PerGroupSumsAvx512: {
        // Each K group of the row has its own scale (the last group also writes the zero tail). The codes multiply
        // the (unsigned) weight codes, so they are wanted signed: q + 128 with its top bit flipped is q's own byte
        // (the tail becomes 0). Each group's sum of q takes the weights' zeros back off.
        uint8_t* row = u8.data() + t * kp;
        const int64_t groups = (K + w.group - 1) / w.group;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t k0 = g * w.group, k1 = std::min(K, k0 + w.group), end = g + 1 == groups ? kp : k1;
          extra[t * groups + g] = x86::quantize_row_u8_avx512(x + k0, k1 - k0, end - k0, row + k0);
          int32_t sum = 0;
          for (int64_t k = k0; k < end; ++k) {
            row[k] ^= 0x80;
            sum += static_cast<int8_t>(row[k]);
          }
          code_sums[t * groups + g] = static_cast<float>(sum);
        }
        break;
      }
      case ActivationLayout::kS8PerToken:
      case ActivationLayout::kS8PerGroupSums: {  // s8 codes (the AVX2 kernels move weight signs onto them), zero tail
        auto* q = reinterpret_cast<int8_t*>(u8.data() + t * kp);
        std::fill(q + K, q + kp, int8_t{0});
        if (layout == ActivationLayout::kS8PerToken) {
          extra[t] = quantize_activations_s8(x, K, q);
          break;
        }
        const int64_t groups = (K + w.group - 1) / w.group;
        quantize_groups_s8(x, K, w.group, q, extra.data() + t * groups);
        for (int64_t g = 0; g < groups; ++g) {
          int32_t sum = 0;
          for (int64_t k = g * w.group; k < std::min(K, (g + 1) * w.group); ++k) sum += q[k];
          code_sums[t * groups + g] = static_cast<float>(sum);
        }
        break;
      }
    }
  }
  // Whether a row's conversion is elementwise (or none at all), so it may be done a column range at a time.
  static bool elementwise(ActivationLayout layout, const PackedWeights&) {
    switch (layout) {
      case ActivationLayout::kF32:
      case ActivationLayout::kBf16:
      case ActivationLayout::kBf16SplitPlanes: return true;
      case ActivationLayout::kF32RoundedBf16:  // elementwise, but converted a row at a time (no convert_columns case)
      case ActivationLayout::kF32RoundedBf16Sums:
      case ActivationLayout::kBf16Sums:
      case ActivationLayout::kS16Codes128:
      case ActivationLayout::kU8PerToken:
      case ActivationLayout::kS8PerToken:
      case ActivationLayout::kS8PerGroupSums:
      case ActivationLayout::kS8PerGroupSumsAvx512: return false;
    }
    return false;
  }
  // Columns [c0, c1) of row x [K] into row t (elementwise(layout, w) only; c0 a multiple of 16); the range that
  // ends at K also writes the zero padding up to k_padded.
  void convert_columns(ActivationLayout layout, const PackedWeights& w, const float* x, int64_t t, int64_t c0,
                       int64_t c1) {
    const int64_t K = w.cols, kp = w.k_padded;
    switch (layout) {
      case ActivationLayout::kF32: break;
      case ActivationLayout::kBf16:
        x86::round_row_bf16_avx512bf16(x + c0, c1 - c0, (c1 == K ? kp : c1) - c0, bf16.data() + t * kp + c0);
        break;
      case ActivationLayout::kBf16SplitPlanes: {
        uint16_t* row = bf16.data() + t * x86::split_row_stride(K) + c0;
        const int64_t plane = x86::split_plane(K);
        x86::split_row_bf16_avx512bf16(x + c0, c1 - c0, (c1 == K ? plane : c1) - c0, row, row + plane);
        break;
      }
      default: MOEX_CHECK(false, "convert_columns: a layout that is not elementwise");
    }
  }
  // The job reads `tokens` converted rows from row t0 (x: the unconverted rows, which kF32 reads).
  void bind(ActivationLayout layout, const PackedWeights& w, const float* x, int64_t t0, x86::PanelJob& job) const {
    const int64_t kp = w.k_padded, groups = static_cast<int64_t>(groups_of(w));
    switch (layout) {
      case ActivationLayout::kF32: job.activations = x; break;
      case ActivationLayout::kF32RoundedBf16Sums: job.group_sums = extra.data() + t0 * groups; [[fallthrough]];
      case ActivationLayout::kF32RoundedBf16: job.activations = f32.data() + t0 * w.cols; break;
      case ActivationLayout::kBf16Sums: job.group_sums = extra.data() + t0 * groups; [[fallthrough]];
      case ActivationLayout::kBf16: job.activations = bf16.data() + t0 * kp; break;
      case ActivationLayout::kBf16SplitPlanes: job.activations = bf16.data() + t0 * x86::split_row_stride(w.cols); break;
      case ActivationLayout::kS16Codes128:
        job.activations = s16.data() + t0 * x86::int8_activation_stride(w.cols);
        job.token_scales = extra.data() + t0 * x86::int8_activation_groups(w.cols);
        break;
      case ActivationLayout::kS8PerGroupSums:
      case ActivationLayout::kS8PerGroupSumsAvx512: job.group_sums = code_sums.data() + t0 * groups; [[fallthrough]];
      case ActivationLayout::kU8PerToken:
      case ActivationLayout::kS8PerToken:
        job.activations = u8.data() + t0 * kp;
        job.token_scales = extra.data() + t0 * groups;
        break;
    }
  }
};

}  // namespace

namespace {

// Per call, on the calling thread; the panel workers read them through the job.
thread_local Activations g_act;

// The choice a call reads: the weight's own (resolved when it was packed), unless the x86 kernels were switched off
// since (set_use_x86_kernels, a test's and a benchmark's switch: then the scalar loop) or on after a packing that
// found them off (then this CPU's choice, made now).
KernelChoice current_choice(const PackedWeights& w) {
  if (!use_x86_kernels() && !use_avx2_kernels()) return KernelChoice{};
  if (w.kernel.isa != Isa::kScalar) return w.kernel;
  return choose_kernel(w.format);
}

constexpr int kMaxOutputs = 4;  // run_group's outputs at most (packed_matmul_group: q, k, v)

// One matrix of a call over shared activations, and where its results go.
struct Output {
  const PackedWeights* w = nullptr;
  x86::Epilogue e;
};

// Every output's matmul of the same x [T, K] in one parallel region: x converted once (the outputs share format, K
// and k_padded), the panels of all outputs one index space that the threads take in chunks.
void run_group(const float* x, int64_t tokens, const Output* outputs, int count, const RowRegime& regime) {
  if (tokens <= 0 || count == 0) return;
  const PackedWeights& w0 = *outputs[0].w;
  const Isa isa = regime.isa;
  if (isa == Isa::kScalar) {
    for (int i = 0; i < count; ++i)
      if (outputs[i].w->rows > 0) run_scalar(x, tokens, *outputs[i].w, outputs[i].e);
    return;
  }
  if (isa == Isa::kAmx) MOEX_CHECK(request_amx_permission(), "Linux refused this process the AMX tile state");
  const int64_t K = w0.cols;
  Activations& act = g_act;  // a name, not the thread_local, reaches the workers
  act.size_for(regime.activations, w0, tokens);
  parallel_for(tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) act.convert(regime.activations, w0, x + t * K, t);
  });
  MOEX_CHECK(count <= kMaxOutputs, "run_group: ", count, " outputs");
  x86::PanelJob jobs[kMaxOutputs];
  int64_t first_panel[kMaxOutputs + 1] = {};  // output i's panels are [first_panel[i], first_panel[i + 1])
  for (int i = 0; i < count; ++i) {
    const PackedWeights& w = *outputs[i].w;
    jobs[i].tokens = tokens;
    jobs[i].many_rows = regime.many_rows;
    jobs[i].w = &w;
    jobs[i].epilogue = outputs[i].e;
    act.bind(regime.activations, w, x, 0, jobs[i]);
    first_panel[i + 1] = first_panel[i] + (w.rows > 0 ? w.panels : 0);
  }
  for_panel_chunks(first_panel[count], [&](int64_t b, int64_t end) {
    for (int i = 0; i < count; ++i) {
      const int64_t lo = std::max(b, first_panel[i]), hi = std::min(end, first_panel[i + 1]);
      if (lo < hi) regime.run(jobs[i], lo - first_panel[i], hi - first_panel[i]);
    }
  });
}

void run(const float* x, int64_t tokens, const PackedWeights& w, const x86::Epilogue& e, const RowRegime& regime) {
  if (w.rows == 0) return;
  const Output output{&w, e};
  run_group(x, tokens, &output, 1, regime);
}

// The regime the weight's choice gives `tokens` rows.
RowRegime regime_for(const PackedWeights& w, int64_t tokens, bool batch_invariant) {
  return current_choice(w).for_rows(tokens, batch_invariant);
}

x86::Epilogue store_into(float* y, const PackedWeights& w, bool accumulate) {
  x86::Epilogue e;
  e.kind = accumulate ? x86::Epilogue::kAccumulate : x86::Epilogue::kStore;
  e.y = y;
  e.ld_y = w.rows;
  return e;
}

}  // namespace

void packed_matmul_group(const float* x, int64_t tokens, const PackedOutput* outputs, int count, bool batch_invariant) {
  if (count <= 0) return;
  const PackedWeights& w0 = *outputs[0].w;
  bool shared = count <= kMaxOutputs;
  for (int i = 0; i < count; ++i) {
    const PackedWeights& w = *outputs[i].w;
    MOEX_CHECK(!w.gate_up, "gate/up weights go to expert_gate_up");
    shared = shared && w.format == w0.format && w.cols == w0.cols && w.k_padded == w0.k_padded && w.group == w0.group;
  }
  if (!shared) {  // activations converted differently: one call each
    for (int i = 0; i < count; ++i)
      packed_matmul(x, tokens, *outputs[i].w, outputs[i].y, outputs[i].accumulate, batch_invariant);
    return;
  }
  Output group[kMaxOutputs];
  for (int i = 0; i < count; ++i) group[i] = {outputs[i].w, store_into(outputs[i].y, *outputs[i].w, outputs[i].accumulate)};
  run_group(x, tokens, group, count, regime_for(w0, tokens, batch_invariant));
}

void packed_matmul(const float* x, int64_t tokens, const PackedWeights& w, float* y, bool accumulate,
                   bool batch_invariant) {
  MOEX_CHECK(!w.gate_up, "gate/up weights go to expert_gate_up");
  run(x, tokens, w, store_into(y, w, accumulate), regime_for(w, tokens, batch_invariant));
}

void packed_matmul_on(Isa isa, const float* x, int64_t tokens, const PackedWeights& w, float* y, bool accumulate,
                      bool batch_invariant) {
  const std::vector<Isa> usable = usable_isas(w.format, cpu_features());
  MOEX_CHECK(std::find(usable.begin(), usable.end(), isa) != usable.end(), isa_name(isa), " cannot run ",
             weight_format_name(w.format), " on this CPU");
  MOEX_CHECK(!w.gate_up, "gate/up weights go to expert_gate_up");
  // The kernels registered on `isa` itself (under kAmx: tiles or, for W8A8's few rows, its VNNI loop, as the
  // registry's kAmx rows say), the loop by that ISA's own crossover.
  RowRegime regime{isa, nullptr, false, ActivationLayout::kF32};
  if (isa != Isa::kScalar) {
    const RowKernel loop = row_kernel_on(w.format, isa, tokens, batch_invariant);
    const KernelEntry* k = find_kernel(w.format, isa, loop);
    MOEX_CHECK(k, "no ", weight_format_name(w.format), " kernel on ", isa_name(isa));
    regime = {isa, k->run, loop == RowKernel::kManyRows, k->activations};
  }
  run(x, tokens, w, store_into(y, w, accumulate), regime);
}

void packed_matmul_with(const KernelEntry& kernel, const float* x, int64_t tokens, const PackedWeights& w, float* y,
                        bool accumulate) {
  const std::vector<Isa> usable = usable_isas(w.format, cpu_features());
  MOEX_CHECK(kernel.format == w.format && std::find(usable.begin(), usable.end(), kernel.isa) != usable.end(),
             isa_name(kernel.isa), " cannot run ", weight_format_name(w.format), " on this CPU");
  MOEX_CHECK(!w.gate_up, "gate/up weights go to expert_gate_up");
  run(x, tokens, w, store_into(y, w, accumulate), RowRegime{kernel.isa, kernel.run, kernel.loop == RowKernel::kManyRows,
                                                            kernel.activations});
}

void expert_gate_up(const float* x, int64_t tokens, const PackedWeights& w13, float* h, bool batch_invariant) {
  MOEX_CHECK(w13.gate_up, "expert_gate_up needs weights from pack_gate_up");
  x86::Epilogue e;
  e.kind = x86::Epilogue::kSiluMul;
  e.y = h;
  e.ld_y = w13.rows;
  run(x, tokens, w13, e, regime_for(w13, tokens, batch_invariant));
}

void expert_down_accumulate(const float* h, int64_t tokens, const PackedWeights& w2, const float* route_weights,
                            const int32_t* out_rows, float* out, int64_t out_stride, bool batch_invariant) {
  MOEX_CHECK(!w2.gate_up && out_stride >= w2.rows, "expert_down_accumulate: out_stride ", out_stride, " < ", w2.rows);
  x86::Epilogue e;
  e.kind = x86::Epilogue::kRoutedAccumulate;
  e.y = out;
  e.ld_y = out_stride;
  e.route_weights = route_weights;
  e.out_rows = out_rows;
  run(h, tokens, w2, e, regime_for(w2, tokens, batch_invariant));
}

namespace {

// The fused pass's bookkeeping, reused call after call (sized up, never down): nothing allocates per step.
struct FusedPlan {
  Activations up, down;                 // x rows for w13, h rows for w2: [R] rows, all experts in order
  std::vector<int64_t> first_row;       // [count] expert's first row in the activations
  std::vector<int32_t> row_expert;      // [R] the expert of each row
  std::vector<RowRegime> expert_regime;  // [count] the ISA and loop each expert's rows run (KernelChoice::for_rows)
  struct Item {
    int32_t expert;
    int64_t begin, end;  // w13 panels
  };
  std::vector<Item> up_items;
};
thread_local FusedPlan g_fused;

// A panel's streaming from DRAM costs about as much as this many rows' dot products on it (mini's bf16
// w13 panel, 128 KB: ~8 us to stream at one core's share of the bandwidth, ~0.6 us per row on vdpbf16ps).
constexpr int64_t kStreamRows = 12;
// Up to this many rows (decode: k per token, a few tokens) the x rows are converted on the calling thread
// before the parallel region: a few microseconds, against one barrier that waits for every thread.
constexpr int64_t kSerialConvertRows = 16;

}  // namespace

void fused_experts(const ExpertRows* experts, int count, float* out, int64_t out_stride, bool batch_invariant) {
  const ExpertRows* first = nullptr;
  int64_t total_rows = 0;
  for (int e = 0; e < count; ++e) {
    const ExpertRows& x = experts[e];
    if (x.rows == 0) continue;
    MOEX_CHECK(x.rows > 0 && x.w13 && x.w2 && x.w13->gate_up && !x.w2->gate_up && x.x && x.h && x.route_weights &&
                   x.out_rows, "fused_experts: expert ", e, " is incomplete");
    if (!first) first = &x;
    MOEX_CHECK(x.w13->format == first->w13->format && x.w2->format == first->w13->format &&
                   x.w13->rows == first->w13->rows && x.w13->cols == first->w13->cols &&
                   x.w2->rows == first->w2->rows && x.w2->cols == x.w13->rows && x.w13->group == first->w13->group &&
                   x.w2->group == first->w2->group,
               "fused_experts: the experts differ in format or shape");
    total_rows += x.rows;
  }
  if (!first) return;
  MOEX_CHECK(out_stride >= first->w2->rows, "fused_experts: out_stride ", out_stride, " < ", first->w2->rows);
  const PackedWeights &w13 = *first->w13, &w2 = *first->w2;
  const KernelChoice choice = current_choice(w13);
  if (choice.isa == Isa::kScalar) {
    for (int e = 0; e < count; ++e) {
      const ExpertRows& x = experts[e];
      if (x.rows == 0) continue;
      expert_gate_up(x.x, x.rows, *x.w13, x.h, batch_invariant);
      expert_down_accumulate(x.h, x.rows, *x.w2, x.route_weights, x.out_rows, out, out_stride, batch_invariant);
    }
    return;
  }
  if (choice.isa == Isa::kAmx || choice.many.isa == Isa::kAmx)
    MOEX_CHECK(request_amx_permission(), "Linux refused this process the AMX tile state");
  FusedPlan& plan = g_fused;  // names, not the thread_local, reach the threads
  // Each expert's rows run where expert_gate_up alone would run them (isa_for_rows by its own row count: on an
  // AMX CPU int8's, int4's and fp8's many-row experts go to tiles, their few-row ones stay on FMA / vdpbf16ps), so
  // the pass equals the expert-by-expert kernels bit for bit. The buffers of both ISAs live in one Activations
  // (each row is converted once, for its expert's ISA); this also reads MOEX_ROW_KERNEL outside the region.
  plan.expert_regime.resize(count);
  bool h_in_items = true;  // every expert's h conversion for w2 is elementwise (see below)
  for (int e = 0; e < count; ++e) {
    const RowRegime& regime = choice.for_rows(experts[e].rows, batch_invariant);
    const ActivationLayout ei = regime.activations;
    plan.expert_regime[e] = regime;
    if (experts[e].rows == 0) continue;
    plan.up.size_for(ei, w13, total_rows);
    plan.down.size_for(ei, w2, total_rows);
    h_in_items = h_in_items && Activations::elementwise(ei, w2);
  }
  plan.first_row.resize(count);
  plan.row_expert.resize(total_rows);
  const int threads = num_threads();
  // Work items of about equal cost, a few per thread; experts with the most rows first (the longest items
  // start first under the dynamic schedule).
  int64_t total_cost = 0;
  for (int e = 0, row = 0; e < count; ++e) {
    plan.first_row[e] = row;
    for (int64_t r = 0; r < experts[e].rows; ++r) plan.row_expert[row + r] = e;
    row += experts[e].rows;
    if (experts[e].rows) total_cost += (experts[e].rows + kStreamRows) * w13.panels;
  }
  const int64_t target = std::max<int64_t>(1, total_cost / (threads * 4));
  plan.up_items.clear();
  for (int e = 0; e < count; ++e) {
    if (experts[e].rows == 0) continue;
    const int64_t per_panel = experts[e].rows + kStreamRows;
    const int64_t chunk = std::clamp<int64_t>((target + per_panel / 2) / per_panel, 1, w13.panels);
    for (int64_t p = 0; p < w13.panels; p += chunk)
      plan.up_items.push_back({e, p, std::min(w13.panels, p + chunk)});
  }
  std::stable_sort(plan.up_items.begin(), plan.up_items.end(), [&](const FusedPlan::Item& a, const FusedPlan::Item& b) {
    return (a.end - a.begin) * (experts[a.expert].rows + kStreamRows) > (b.end - b.begin) * (experts[b.expert].rows + kStreamRows);
  });
  const int64_t up_items = static_cast<int64_t>(plan.up_items.size());
  const int64_t down_chunk = std::max<int64_t>(1, w2.panels / (threads * 4));
  const int64_t down_items = (w2.panels + down_chunk - 1) / down_chunk;
  const int64_t hidden = w13.cols, inter = w13.rows;
  const auto job_for = [&](const PackedWeights& w, const Activations& act, const float* x, int e) {
    x86::PanelJob job;
    job.tokens = experts[e].rows;
    job.many_rows = plan.expert_regime[e].many_rows;
    job.w = &w;
    act.bind(plan.expert_regime[e].activations, w, x, plan.first_row[e], job);
    return job;
  };
  // Barriers: decode (few rows) converts x here, before the region; when h's conversion for w2 is
  // elementwise (bf16 rounding; none for int8) each gate/up item converts the h columns it wrote. Then
  // the region has one barrier between gate/up and down (two more for int4 and W8A8 prefill).
  const bool x_before = total_rows <= kSerialConvertRows;
  if (x_before) {
    for (int64_t r = 0; r < total_rows; ++r) {
      const int e = plan.row_expert[r];
      plan.up.convert(plan.expert_regime[e].activations, w13, experts[e].x + (r - plan.first_row[e]) * hidden, r);
    }
  }
#pragma omp parallel num_threads(threads)
  {
    if (!x_before) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < total_rows; ++r) {
        const int e = plan.row_expert[r];
        plan.up.convert(plan.expert_regime[e].activations, w13, experts[e].x + (r - plan.first_row[e]) * hidden, r);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < up_items; ++i) {
      const FusedPlan::Item& item = plan.up_items[i];
      const ExpertRows& x = experts[item.expert];
      x86::PanelJob job = job_for(*x.w13, plan.up, x.x, item.expert);
      job.epilogue.kind = x86::Epilogue::kSiluMul;
      job.epilogue.y = x.h;
      job.epilogue.ld_y = inter;
      const ActivationLayout ei = plan.expert_regime[item.expert].activations;
      plan.expert_regime[item.expert].run(job, item.begin, item.end);
      if (h_in_items) {  // h [rows, I] columns of panels [begin, end)
        const int64_t c0 = item.begin * w13.rows_per_panel(), c1 = std::min(inter, item.end * w13.rows_per_panel());
        for (int64_t r = 0; r < x.rows; ++r)
          plan.down.convert_columns(ei, w2, x.h + r * inter, plan.first_row[item.expert] + r, c0, c1);
      }
    }
    if (!h_in_items) {
#pragma omp for schedule(static)
      for (int64_t r = 0; r < total_rows; ++r) {
        const int e = plan.row_expert[r];
        plan.down.convert(plan.expert_regime[e].activations, w2, experts[e].h + (r - plan.first_row[e]) * inter, r);
      }
    }
#pragma omp for schedule(dynamic, 1) nowait  // the region's end is the barrier
    for (int64_t i = 0; i < down_items; ++i) {
      const int64_t begin = i * down_chunk, end = std::min(w2.panels, begin + down_chunk);
      for (int e = 0; e < count; ++e) {  // expert order: the same sum as expert_down_accumulate one by one
        const ExpertRows& x = experts[e];
        if (x.rows == 0) continue;
        x86::PanelJob job = job_for(*x.w2, plan.down, x.h, e);
        job.epilogue.kind = x86::Epilogue::kRoutedAccumulate;
        job.epilogue.y = out;
        job.epilogue.ld_y = out_stride;
        job.epilogue.route_weights = x.route_weights;
        job.epilogue.out_rows = x.out_rows;
        plan.expert_regime[e].run(job, begin, end);
      }
    }
  }
}

}  // namespace moex::kernels
