// The AMX compute probes: tdpbf16ps / tdpbusd back to back on tile registers, nothing else in the loop.
// Tiles 0-3 are four independent C accumulators (16 rows x 16 f32 / s32), 4-5 two A tiles and 6-7 two B
// tiles, all 16 rows x 64 bytes: each round issues the four (C, A, B) pairs, so a chain waits for its own C
// only every fourth instruction. A holds 1 in its first element of every row and 0 elsewhere, B all ones,
// so every C element grows by exactly 1 per instruction and the sum proves the count.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "tools/lib/probes.h"

namespace moex::kernels::x86 {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}

// Sum of tiles 0-3 (f32 or s32 elements) after the loop.
template <typename T>
double sum_c() {
  alignas(64) T c[4][16 * 16];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
  double sum = 0;
  for (auto& tile : c)
    for (T v : tile) sum += static_cast<double>(v);
  return sum;
}

}  // namespace

namespace {

// iterations x kAmxPeakRounds x 4 products: tdpbusd (int8) or tdpbf16ps, A = `a` in tiles 4-5, B = `b` in 6-7.
template <bool kInt8, typename C>
double tile_loop(int64_t iterations, const void* a, const void* b) {
  configure();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b, 64);
  for (int64_t i = 0; i < iterations; ++i)
    for (int round = 0; round < kAmxPeakRounds; ++round) {
      if constexpr (kInt8) {
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
      } else {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  const double sum = sum_c<C>();
  _tile_release();
  return sum;
}

}  // namespace

double tdpbf16_loop_amx(int64_t iterations, uint16_t one_bf16) {
  alignas(64) uint16_t a[16 * 32] = {}, b[16 * 32];
  for (int r = 0; r < 16; ++r) a[r * 32] = one_bf16;
  for (uint16_t& v : b) v = one_bf16;
  return tile_loop<false, float>(iterations, a, b);
}

double tdpbusd_loop_amx(int64_t iterations, uint8_t one) {
  alignas(64) uint8_t a[16 * 64] = {}, b[16 * 64];
  for (int r = 0; r < 16; ++r) a[r * 64] = one;
  std::memset(b, one, sizeof b);
  return tile_loop<true, int32_t>(iterations, a, b);
}

}  // namespace moex::kernels::x86
