// bf16 x bf16 -> f32 on AMX tiles (tdpbf16ps), over the same VNNI-pair panels as the AVX-512 kernel:
// a panel's k pairs are rows of 64 lanes x 2 bf16, so 16 pairs of 16 lanes are exactly one B tile (16 rows
// of 64 bytes, 256 bytes apart). One C tile per 16 lanes (4 per panel), A = up to 16 tokens x 32 k.
// Written on a machine without AMX: usable_isas() offers it (so the tests run it against the reference
// on an AMX CPU) but kernel_isa() does not pick it until a session on such a CPU has measured it.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "moex/kernels/x86/packed_x86.h"
#include "moex/kernels/x86/vec_avx512.h"

namespace moex::kernels::x86 {
namespace {

constexpr int kTileRows = 16;   // tokens per A / C tile
constexpr int64_t kTileK = 32;  // bf16 per A row (64 bytes); k_padded of kBF16 is a multiple of it

// Palette 1: tiles 0-3 C (rows x 16 f32), 4 A (rows x 32 bf16), 5-7 B (16 pair rows x 16 lanes x 2 bf16).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TileConfig config_for(int rows) {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = static_cast<uint8_t>(i < 5 ? rows : 16);
  }
  return c;
}

// c [rows][64] = x [rows][kp] (bf16) . panel [kp/2][64][2], all of K in the tiles.
void panel_tile(const uint16_t* x, int64_t kp, const uint16_t* panel, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  constexpr int64_t kPairRowBytes = kPanel * 2 * 2;  // 256
  for (int64_t k0 = 0; k0 < kp; k0 += kTileK) {
    const uint16_t* b = panel + k0 * kPanel;  // pair row k0/2
    _tile_loadd(4, x + k0, kp * 2);
    _tile_loadd(5, b, kPairRowBytes);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 32, kPairRowBytes);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, b + 64, kPairRowBytes);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + 96, kPairRowBytes);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, c, kPanel * 4);
  _tile_stored(1, c + 16, kPanel * 4);
  _tile_stored(2, c + 32, kPanel * 4);
  _tile_stored(3, c + 48, kPanel * 4);
}

}  // namespace

void run_panels_bf16_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const uint16_t*>(job.activations);  // [T][k_padded] bf16
  const int64_t tokens = job.tokens, kp = w.k_padded;
  thread_local std::vector<float> c;  // [T][64]
  if (c.size() < static_cast<size_t>(tokens * kPanel)) c.resize(tokens * kPanel);
  if (kp == 0) std::fill_n(c.begin(), tokens * kPanel, 0);
  const TileConfig full = config_for(kTileRows), tail = config_for(static_cast<int>(tokens % kTileRows));
  for (int64_t panel = panel_begin; panel < panel_end && kp > 0; ++panel) {
    const uint16_t* w_panel = w.data.as<const uint16_t>() + panel * kp * kPanel;
    int64_t t = 0;
    if (tokens >= kTileRows) {
      _tile_loadconfig(&full);
      for (; t + kTileRows <= tokens; t += kTileRows) panel_tile(x + t * kp, kp, w_panel, c.data() + t * kPanel);
    }
    if (t < tokens) {
      _tile_loadconfig(&tail);
      panel_tile(x + t * kp, kp, w_panel, c.data() + t * kPanel);
    }
    apply_epilogue(job.epilogue, w, panel, tokens, c.data());
  }
  if (kp == 0)
    for (int64_t panel = panel_begin; panel < panel_end; ++panel) apply_epilogue(job.epilogue, w, panel, tokens, c.data());
  _tile_release();
}

}  // namespace moex::kernels::x86
