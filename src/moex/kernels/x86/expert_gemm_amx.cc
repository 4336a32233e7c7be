// The many-row GEMMs on AMX tiles: bf16 (tdpbf16ps) and W8A8 (tdpbusd), over the same panels the AVX-512
// kernels read. Hand-written: oneDNN's AMX brgemm wants its own blocked layout and a reorder per call, and no
// Debian library runs tiles over these panels with a fused epilogue.
//
// Both panels have one geometry in bytes: a row of 64 lanes x 4 bytes per k step (a bf16 pair or an s8 quad),
// 256 bytes apart. So a B tile (16 rows x 64 bytes, stride 256) is 16 k steps of 16 lanes, four of them side by
// side cover the panel, and an A tile is 16 tokens x 64 bytes of their activation rows (32 bf16 or 64 u8 k).
// k_padded is a multiple of 64 bytes' worth of k for both formats (packed.cc), so no tile runs past a panel.
//   per 64-byte k step: A -> tile 4; B lanes 0-15, 16-31, 32-47, 48-63 -> tiles 5, 6, 7, 5; C[v] += A . B[v]
//   C tiles 0-3: 16 tokens x 16 lanes (f32 / s32), stored to c [T][64] once the panel's K is done.
// Token blocks are 16 rows; a call with T >= 16 runs its last block on rows T-16..T-1 (overlapping the block
// before: those rows are computed twice, to the same values), so every call needs one tile configuration. Two
// blocks (17-32 rows) run as one 32-row block per half of the lanes (block32_half), loading each B tile once.
// Prefetch into L2: the first pass over a panel streams it from memory and keeps the prefetch kLead bytes ahead
// of its reads; later passes read it from L2 and spread the next panel's lines over their k steps.
//
// A row's sums do not depend on the other rows of its tile, so a row's result is the same at any row count. bf16:
// tdpbf16ps sums a k pair in another order than vdpbf16ps, so on AMX CPUs every bf16 call runs here, even one
// row (measured no slower than the AVX-512 few-row loop: docs/kernels.md), and a row's bits never depend on its
// call's row count. W8A8: integer sums are exact and the epilogue is the VNNI loops', so the VNNI few-row loop
// (below kAmxManyRowsFrom rows) gives the same bits.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "moex/kernels/x86/packed_x86.h"
#include "moex/kernels/x86/vec_avx512.h"

namespace moex::kernels::x86 {
namespace {

constexpr int kTileRows = 16;          // tokens per A / C tile
constexpr int64_t kStepBytes = 64;     // bytes of an activation row per k step (one A tile row)
constexpr int64_t kLaneRowBytes = 256;  // a panel's 64 lanes x 4 bytes: one k pair (bf16) or quad (s8)
constexpr int64_t kStepPanelBytes = 16 * kLaneRowBytes;  // a panel's bytes per k step (four B tiles)
// How far ahead of its reads a block streaming its panel from memory prefetches. Measured on the AMX Xeon (bench
// kernels, bf16, 1 thread): prefetching the whole next panel during this one (458 KB ahead for `down`) held one
// row's down at 83% of the read probe, 8-128 KB ahead gave 101-111%, 512 KB 80%; 32 KB is in the middle.
constexpr int64_t kLead = 32 << 10;
constexpr int kMaxLinesPerStep = 128;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 C (rows x 16 x 4 bytes), 4 A (rows x 64 bytes), 5-7 B (16 x 64 bytes).
void configure(int rows) {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = static_cast<uint8_t>(i < 5 ? rows : 16);
  }
  _tile_loadconfig(&c);
}

// C += A . B on tiles; the tile numbers must be constants, hence a macro.
#define MOEX_AMX_DOT(C, A, B)                  \
  if constexpr (kInt8) _tile_dpbusd(C, A, B);  \
  else _tile_dpbf16ps(C, A, B)

// The L2 prefetch of a call's panels: a cursor that never passes `end` (this call's last byte) and, at each k
// step, is moved up to a target (at most kMaxLinesPerStep lines at a time, so a far target does not flood the
// queue). A block reading its panel from memory (the first) keeps it kLead bytes ahead of its reads; later
// blocks re-read the panel from L2 and spread the next panel's lines over their steps.
struct Prefetch {
  const char* cursor;
  const char* end;
  void to(const char* target) {
    target = std::min(target, end);
    for (int i = 0; i < kMaxLinesPerStep && cursor < target; ++i, cursor += 64) _mm_prefetch(cursor, _MM_HINT_T1);
  }
};

// Up to 16 rows: c [rows][64] (4-byte elements) = x [rows][steps x 64 bytes] . panel [steps x 16 rows][256 bytes].
// Tiles: C 0-3 (lanes 0-15 .. 48-63), A 4, B 5-7 (5 holds lanes 0-15, then 48-63). Step s moves the prefetch
// cursor to first_target + s * target_step.
template <bool kInt8>
void block16(const uint8_t* x, int64_t ldx, const uint8_t* panel, int64_t steps, void* c, Prefetch& prefetch,
             const char* first_target, double target_step) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const uint8_t* b = panel + s * kStepPanelBytes;
    _tile_loadd(4, x + s * kStepBytes, ldx);
    _tile_loadd(5, b, kLaneRowBytes);
    MOEX_AMX_DOT(0, 4, 5);
    _tile_loadd(6, b + 64, kLaneRowBytes);
    MOEX_AMX_DOT(1, 4, 6);
    _tile_loadd(7, b + 128, kLaneRowBytes);
    MOEX_AMX_DOT(2, 4, 7);
    _tile_loadd(5, b + 192, kLaneRowBytes);
    MOEX_AMX_DOT(3, 4, 5);
    prefetch.to(first_target + static_cast<int64_t>(s * target_step));
  }
  auto* out = static_cast<uint8_t*>(c);
  _tile_stored(0, out, kPanel * 4);
  _tile_stored(1, out + 64, kPanel * 4);
  _tile_stored(2, out + 128, kPanel * 4);
  _tile_stored(3, out + 192, kPanel * 4);
}

// 32 rows (two A tiles, rows x0 and x1), one half of the panel's lanes (32 lanes): c [rows][64] gains lanes
// 32 h .. 32 h + 31. Tiles: C 0-1 (x0 . lanes 0-15, 16-31 of the half), C 2-3 (x1 . the same), A 4-5, B 6-7. Each
// B tile is loaded once for 32 rows; the two halves read the panel's lines 0-1 and 2-3 of each 256-byte k row.
template <bool kInt8>
void block32_half(const uint8_t* x0, const uint8_t* x1, int64_t ldx, const uint8_t* panel, int64_t steps, int h,
                  void* c0, void* c1, Prefetch& prefetch, const char* first_target, double target_step) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const uint8_t* b = panel + s * kStepPanelBytes + h * 128;
    _tile_loadd(4, x0 + s * kStepBytes, ldx);
    _tile_loadd(6, b, kLaneRowBytes);
    MOEX_AMX_DOT(0, 4, 6);
    _tile_loadd(7, b + 64, kLaneRowBytes);
    MOEX_AMX_DOT(1, 4, 7);
    _tile_loadd(5, x1 + s * kStepBytes, ldx);
    MOEX_AMX_DOT(2, 5, 6);
    MOEX_AMX_DOT(3, 5, 7);
    prefetch.to(first_target + static_cast<int64_t>(s * target_step));
  }
  auto* out0 = static_cast<uint8_t*>(c0) + h * 128;
  auto* out1 = static_cast<uint8_t*>(c1) + h * 128;
  _tile_stored(0, out0, kPanel * 4);
  _tile_stored(1, out0 + 64, kPanel * 4);
  _tile_stored(2, out1, kPanel * 4);
  _tile_stored(3, out1 + 64, kPanel * 4);
}
#undef MOEX_AMX_DOT

template <bool kInt8>
void run_panels(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const uint8_t*>(job.activations);  // [T][k_padded] bf16 or u8 (q + 128)
  const int64_t tokens = job.tokens, elem = kInt8 ? 1 : 2, ldx = w.k_padded * elem;
  const int64_t steps = ldx / kStepBytes, panel_bytes = steps * 16 * kLaneRowBytes;
  thread_local std::vector<float> c;    // [T][64] f32 sums (bf16), or s32 sums (W8A8, read only by intrinsics)
  thread_local std::vector<float> f;    // [T][64] W8A8's scaled sums
  if (c.size() < static_cast<size_t>(tokens * kPanel)) {
    c.resize(tokens * kPanel);
    f.resize(tokens * kPanel);
  }
  if (steps == 0) std::fill_n(c.begin(), tokens * kPanel, 0);  // an empty sum: no block runs to write c
  // Blocks of 16 rows (one of `rows` rows below 16); the last block ends at row T - 1.
  const int rows = static_cast<int>(std::min<int64_t>(tokens, kTileRows));
  const int64_t blocks = (tokens + kTileRows - 1) / kTileRows;
  if (steps > 0) configure(rows);
  const auto* data = w.data.as<const uint8_t>();
  Prefetch prefetch{reinterpret_cast<const char*>(data + panel_begin * panel_bytes),
                    reinterpret_cast<const char*>(data + panel_end * panel_bytes)};  // this call's panels only
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const uint8_t* w_panel = data + panel * panel_bytes;
    const char* next_panel = reinterpret_cast<const char*>(w_panel + panel_bytes);
    // Passes over the panel: two blocks (17-32 rows) as two 32-row lane halves, each B tile loaded once for both
    // (the fused pass at decode batch 64 gives many experts 17-20 rows). More blocks run one by one: pairing them
    // too was slower for down (K = 3584: the A tiles of 32 rows come from L2 twice per k step).
    const int64_t pairs = blocks == 2 ? 1 : 0, passes = pairs * 2 + (blocks - pairs * 2);
    for (int64_t p = 0; p < passes && steps > 0; ++p) {
      // Pass 0 streams the panel: kLead ahead of step s's reads. Passes 1.. spread the next panel over their steps.
      const char* first_target = reinterpret_cast<const char*>(w_panel) + kStepPanelBytes + kLead;
      double target_step = kStepPanelBytes;
      if (p > 0) {
        target_step = double(panel_bytes) / double((passes - 1) * steps);
        first_target = next_panel + static_cast<int64_t>(((p - 1) * steps + 1) * target_step);
      }
      if (p < pairs * 2) {
        const int64_t t0 = (p / 2) * 2 * kTileRows, t1 = std::min(t0 + kTileRows, tokens - rows);
        block32_half<kInt8>(x + t0 * ldx, x + t1 * ldx, ldx, w_panel, steps, static_cast<int>(p % 2),
                            c.data() + t0 * kPanel, c.data() + t1 * kPanel, prefetch, first_target, target_step);
      } else {
        const int64_t t = std::min(p * kTileRows, tokens - rows);  // the last block, alone
        block16<kInt8>(x + t * ldx, ldx, w_panel, steps, c.data() + t * kPanel, prefetch, first_target, target_step);
      }
    }
    if constexpr (kInt8) {
      w8a8_panel_to_f32(job, panel, reinterpret_cast<const int32_t*>(c.data()), f.data());
      apply_epilogue(job.epilogue, w, panel, tokens, f.data());
    } else {
      apply_epilogue(job.epilogue, w, panel, tokens, c.data());
    }
  }
  if (steps > 0) _tile_release();
}

}  // namespace

void run_panels_bf16_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  run_panels<false>(job, panel_begin, panel_end);
}

void run_panels_w8a8_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  run_panels<true>(job, panel_begin, panel_end);
}

}  // namespace moex::kernels::x86
