// The many-row (prefill) bf16 GEMM: c [T][64] = x [T][K] (bf16) . one VNNI-pair panel [K/2][64][2], for calls
// from the registry's crossover (kernels/formats.cc). Hand-written: no Debian library runs vdpbf16ps
// over these panels with a fused epilogue (oneDNN's brgemm would need its own layout and a copy per call).
// What it adds to the few-row tile loop (packed_bf16_avx512bf16.cc):
//  - software prefetch: while a panel's K block is computed token tile by token tile (from L2), the next K
//    block (or the next panel) is pulled from DRAM into L2, its lines shared out over all the tiles in
//    proportion to their rows and spread over each tile's k steps (SpreadPrefetch), so the first tile of a block
//    no longer waits on DRAM (at ~128 rows per expert that wait was ~10% of the call) and the stream runs during
//    every tile's arithmetic (a burst in the first tiles left the last ones' outside it: W8A8 gate_up at 16 / 64
//    rows 416-420 / 968-1,013 us -> 380-400 / 819-874, bench kernels under MOEX_ISA=avx512 on the AMX Xeon);
//  - balanced token tiles: T rows in ceil(T / 6) tiles of 5 or 6 rows, never a 1- or 2-row tail tile whose
//    weight loads from L2 feed only 4 or 8 dot products.
// Per lane every row sums its k pairs in the same order with the same instruction as the few-row loop (the
// running sums go through c exactly, f32 stores and loads), so the two loops give the same bits: which one
// runs never changes a row's result.
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
constexpr int64_t kKBlock = 2048;  // k per pass: the panel's slice (256 KB) stays in L2 while the tiles pass

// c [MT][64] (+)= x [MT][ldx] (bf16, k pairs from here) . w [pairs][64][2]; each k step moves
// `prefetch` on by its share of the tile's lines (into L2).
template <int MT>
void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, float* c, bool load_c, SpreadPrefetch prefetch) {
  __m512 acc[MT][4];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 4; ++v) acc[t][v] = load_c ? _mm512_loadu_ps(c + t * kPanel + 16 * v) : _mm512_setzero_ps();
  const auto step = [&](int64_t p) {
    const uint16_t* wp = w + p * 2 * kPanel;
    const __m512bh w0 = load_pairs(wp), w1 = load_pairs(wp + 32), w2 = load_pairs(wp + 64), w3 = load_pairs(wp + 96);
    for (int t = 0; t < MT; ++t) {
      const __m512bh xv = broadcast_pair(x + t * ldx + 2 * p);
      acc[t][0] = _mm512_dpbf16_ps(acc[t][0], xv, w0);
      acc[t][1] = _mm512_dpbf16_ps(acc[t][1], xv, w1);
      acc[t][2] = _mm512_dpbf16_ps(acc[t][2], xv, w2);
      acc[t][3] = _mm512_dpbf16_ps(acc[t][3], xv, w3);
    }
  };
  for (int64_t p = 0; p < pairs; ++p) {
    prefetch.next();
    step(p);
  }
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(c + t * kPanel + 16 * v, acc[t][v]);
}

}  // namespace

void run_panels_bf16_many_avx512bf16(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const uint16_t*>(job.activations);  // [T][k_padded] bf16
  const int64_t tokens = job.tokens, kp = w.k_padded;
  thread_local std::vector<float> c;  // [T][64]: one panel's sums across K blocks
  if (c.size() < static_cast<size_t>(tokens * kPanel)) c.resize(tokens * kPanel);
  if (w.cols == 0) std::fill_n(c.begin(), tokens * kPanel, 0);  // an empty sum: no K block runs to write c
  // Balanced tiles: `tiles` of `base` rows, the first `longer` of them one more.
  const int64_t tiles = (tokens + kMaxTile - 1) / kMaxTile, base = tokens / std::max<int64_t>(tiles, 1),
                longer = tokens - base * tiles;
  const uint16_t* w_all = w.data.as<const uint16_t>();
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const uint16_t* w_panel = w_all + panel * kp * kPanel;  // [kp/2][64][2]
    for (int64_t k0 = 0; k0 < kp; k0 += kKBlock) {
      const int64_t pairs = (std::min(kp, k0 + kKBlock) - k0) / 2;
      const uint16_t* wk = w_panel + k0 * kPanel;
      // What the next pass reads: this panel's next K block, else the next panel's first one (the panels are
      // contiguous); 128 bytes (2 lines) per k.
      const int64_t next_k = k0 + kKBlock < kp         ? std::min(kKBlock, kp - k0 - kKBlock)
                             : panel + 1 < panel_end ? std::min(kKBlock, kp)
                                                    : 0;
      const int64_t next_lines = next_k * 2;
      const char* prefetch = reinterpret_cast<const char*>(wk + pairs * 2 * kPanel);
      const bool load_c = k0 > 0;
      int64_t t = 0;
      for (int64_t i = 0; i < tiles; ++i) {
        const int mt = static_cast<int>(base + (i < longer ? 1 : 0));
        const uint16_t* xt = x + t * kp + k0;
        float* ct = c.data() + t * kPanel;
        // This tile's share of the next block's lines, in proportion to its rows.
        const int64_t first_line = next_lines * t / tokens, end_line = next_lines * (t + mt) / tokens;
        const SpreadPrefetch pf{prefetch + first_line * 64, end_line - first_line, pairs};
        switch (mt) {
          case 6: tile<6>(xt, kp, wk, pairs, ct, load_c, pf); break;
          case 5: tile<5>(xt, kp, wk, pairs, ct, load_c, pf); break;
          case 4: tile<4>(xt, kp, wk, pairs, ct, load_c, pf); break;
          case 3: tile<3>(xt, kp, wk, pairs, ct, load_c, pf); break;
          case 2: tile<2>(xt, kp, wk, pairs, ct, load_c, pf); break;
          case 1: tile<1>(xt, kp, wk, pairs, ct, load_c, pf); break;
          default: break;
        }
        t += mt;
      }
    }
    apply_epilogue(job.epilogue, w, panel, tokens, c.data());
  }
}

}  // namespace moex::kernels::x86
