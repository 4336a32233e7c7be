// The many-row (prefill) W8A8 GEMM: c [T][64] = x [T][K] (u8 codes q + 128) . one s8 panel [K/4][64][4] with
// vpdpbusd, for calls from the registry's crossover (kernels/formats.cc). Hand-written for the same
// reason as expert_gemm_avx512bf16.cc, whose structure it follows; what it adds to the few-row loop
// (packed_w8a8_avx512vnni.cc):
//  - software prefetch: while a panel's K block is computed token tile by token tile (from L2), the next K
//    block (or the next panel) is pulled from DRAM into L2, its lines shared out over all the tiles in
//    proportion to their rows and spread over each tile's k steps (SpreadPrefetch), so the first tile of a block
//    no longer waits on DRAM (at ~128 rows per expert that wait was ~10% of the call) and the stream runs during
//    every tile's arithmetic (a burst in the first tiles left the last ones' outside it: W8A8 gate_up at 16 / 64
//    rows 416-420 / 968-1,013 us -> 380-400 / 819-874, bench kernels under MOEX_ISA=avx512 on the AMX Xeon);
//  - balanced token tiles: T rows in ceil(T / 6) tiles of 5 or 6 rows, never a 1- or 2-row tail tile whose
//    weight loads from L2 feed only 4 or 8 dot products.
// Integer sums are exact, so the two loops give the same bits (and the reference's): which one runs never
// changes a row's result. The offset and scale epilogue is the few-row loop's.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "moex/kernels/x86/packed_x86.h"
#include "moex/kernels/x86/prefetch.h"
#include "moex/kernels/x86/vec_avx512.h"

namespace moex::kernels::x86 {
namespace {

constexpr int kMaxTile = 6;        // rows per register tile: 6 x 4 accumulators, 4 weight vectors, a broadcast
constexpr int64_t kKBlock = 4096;  // k per pass: the panel's slice (256 KB) stays in L2 while the tiles pass

inline __m512i broadcast_quad(const uint8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, sizeof quad);
  return _mm512_set1_epi32(quad);
}

// c [MT][64] (+)= x [MT][ldx] (u8, k quads from here) . w [quads][64][4]; each k step moves
// `prefetch` on by its share of the tile's lines (into L2).
template <int MT>
void tile(const uint8_t* x, int64_t ldx, const int8_t* w, int64_t quads, int32_t* c, bool load_c, SpreadPrefetch prefetch) {
  // __v16si, as in the few-row loop: GCC 12 keeps these in registers, an array of __m512i it spills.
  __v16si acc[MT][4];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 4; ++v) acc[t][v] = load_c ? __v16si(_mm512_loadu_si512(c + t * kPanel + 16 * v)) : __v16si{};
  const auto step = [&](int64_t q) {
    const int8_t* wq = w + q * 4 * kPanel;
    const __m512i w0 = _mm512_load_si512(wq), w1 = _mm512_load_si512(wq + 64), w2 = _mm512_load_si512(wq + 128),
                  w3 = _mm512_load_si512(wq + 192);
    for (int t = 0; t < MT; ++t) {
      const __m512i xv = broadcast_quad(x + t * ldx + 4 * q);
      acc[t][0] = __v16si(_mm512_dpbusd_epi32(__m512i(acc[t][0]), xv, w0));
      acc[t][1] = __v16si(_mm512_dpbusd_epi32(__m512i(acc[t][1]), xv, w1));
      acc[t][2] = __v16si(_mm512_dpbusd_epi32(__m512i(acc[t][2]), xv, w2));
      acc[t][3] = __v16si(_mm512_dpbusd_epi32(__m512i(acc[t][3]), xv, w3));
    }
  };
  for (int64_t q = 0; q < quads; ++q) {
    prefetch.next();
    step(q);
  }
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 4; ++v) _mm512_storeu_si512(c + t * kPanel + 16 * v, __m512i(acc[t][v]));
}

}  // namespace

void run_panels_w8a8_many_avx512vnni(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const uint8_t*>(job.activations);  // [T][k_padded] q + 128
  const int64_t tokens = job.tokens, kp = w.k_padded;
  thread_local std::vector<int32_t> c;  // [T][64] integer sums
  thread_local std::vector<float> f;    // [T][64] scaled
  if (c.size() < static_cast<size_t>(tokens * kPanel)) {
    c.resize(tokens * kPanel);
    f.resize(tokens * kPanel);
  }
  if (w.cols == 0) std::fill_n(c.begin(), tokens * kPanel, 0);  // an empty sum: no K block runs to write c
  // Balanced tiles: `tiles` of `base` rows, the first `longer` of them one more.
  const int64_t tiles = (tokens + kMaxTile - 1) / kMaxTile, base = tokens / std::max<int64_t>(tiles, 1),
                longer = tokens - base * tiles;
  const int8_t* w_all = w.data.as<const int8_t>();
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const int8_t* w_panel = w_all + panel * kp * kPanel;  // [kp/4][64][4]
    for (int64_t k0 = 0; k0 < kp; k0 += kKBlock) {
      const int64_t quads = (std::min(kp, k0 + kKBlock) - k0) / 4;
      const int8_t* wk = w_panel + k0 * kPanel;
      // What the next pass reads: this panel's next K block, else the next panel's first one (the panels are
      // contiguous); 64 bytes (1 line) per k.
      const int64_t next_k = k0 + kKBlock < kp         ? std::min(kKBlock, kp - k0 - kKBlock)
                             : panel + 1 < panel_end ? std::min(kKBlock, kp)
                                                    : 0;
      const int64_t next_lines = next_k;
      const char* prefetch = reinterpret_cast<const char*>(wk + quads * 4 * kPanel);
      const bool load_c = k0 > 0;
      int64_t t = 0;
      for (int64_t i = 0; i < tiles; ++i) {
        const int mt = static_cast<int>(base + (i < longer ? 1 : 0));
        const uint8_t* xt = x + t * kp + k0;
        int32_t* ct = c.data() + t * kPanel;
        // This tile's share of the next block's lines, in proportion to its rows.
        const int64_t first_line = next_lines * t / tokens, end_line = next_lines * (t + mt) / tokens;
        const SpreadPrefetch pf{prefetch + first_line * 64, end_line - first_line, quads};
        switch (mt) {
          case 6: tile<6>(xt, kp, wk, quads, ct, load_c, pf); break;
          case 5: tile<5>(xt, kp, wk, quads, ct, load_c, pf); break;
          case 4: tile<4>(xt, kp, wk, quads, ct, load_c, pf); break;
          case 3: tile<3>(xt, kp, wk, quads, ct, load_c, pf); break;
          case 2: tile<2>(xt, kp, wk, quads, ct, load_c, pf); break;
          case 1: tile<1>(xt, kp, wk, quads, ct, load_c, pf); break;
          default: break;
        }
        t += mt;
      }
    }
    w8a8_panel_to_f32(job, panel, c.data(), f.data());  // the few-row loop's epilogue
    apply_epilogue(job.epilogue, w, panel, tokens, f.data());
  }
}

}  // namespace moex::kernels::x86
