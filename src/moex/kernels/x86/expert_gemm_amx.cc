// The many-row GEMMs on AMX tiles: bf16 (tdpbf16ps) and W8A8 (tdpbusd), over the same panels the AVX-512
// kernels read; below them the weight-only formats (int8, int4, fp8: their codes decoded per K group to bf16
// pairs) and W4A8 (its nibbles split into u8 quads for tdpbsud). Hand-written: oneDNN's AMX brgemm wants its own blocked layout and a reorder per call, and no
// Debian library runs tiles over these panels with a fused epilogue.
//
// Both panels have one geometry in bytes: a row of 64 lanes x 4 bytes per k step (a bf16 pair or an s8 quad),
// 256 bytes apart. So a B tile (16 rows x 64 bytes, stride 256) is 16 k steps of 16 lanes, four of them side by
// side cover the panel, and an A tile is 16 tokens x 64 bytes of their activation rows (32 bf16 or 64 u8 k).
// k_padded is a multiple of 64 bytes' worth of k for both formats (packed.cc), so no tile runs past a panel.
//   per 64-byte k step: A -> tile 4; B lanes 0-15, 16-31, 32-47, 48-63 -> tiles 5, 6, 7, 5; C[v] += A . B[v]
//   C tiles 0-3: 16 tokens x 16 lanes (f32 / s32), stored to c [T][64] once the panel's K (or slice) is done.
// Token blocks are 16 rows; a call with T >= 16 runs its last block on rows T-16..T-1 (overlapping the block
// before: those rows are computed twice, to the same values), so every call needs one tile configuration. Two
// blocks (17-32 rows) run as one 32-row block per half of the lanes (block32_half), loading each B tile once.
// More than one pass over a panel (17 rows and up) goes slice by slice: every pass runs over one slice of k
// steps (128 KB of the panel, 512 KB from five blocks) before any moves on, C carried through the c rows between
// slices, so the later passes find the slice in L2 however large the panel is (Mixtral's down: 1.8 MB, most of
// L2). Prefetch into L2: kLead bytes ahead of the first pass's reads; later passes spread the next slice's lines.
//
// A row's sums do not depend on the other rows of its tile, so a row's result is the same at any row count. bf16:
// tdpbf16ps sums a k pair in another order than vdpbf16ps, so on AMX CPUs every bf16 call runs here, even one
// row (measured no slower than the AVX-512 few-row loop: docs/kernels.md), and a row's bits never depend on its
// call's row count. W8A8: integer sums are exact and the epilogue is the VNNI loops', so the VNNI few-row loop
// (below the registry's AMX crossover) gives the same bits.
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
// How far ahead of its reads the first pass over a panel prefetches. Measured on the AMX Xeon (bench
// kernels, bf16, 1 thread): prefetching the whole next panel during this one (458 KB ahead for `down`) held one
// row's down at 83% of the read probe, 8-128 KB ahead gave 101-111%, 512 KB 80%; 32 KB is in the middle.
constexpr int64_t kLead = 32 << 10;
constexpr int kMaxLinesPerStep = 128;
// k steps per slice when a panel takes several passes: 32 (128 KB of panel) for 2-4 token blocks (decode
// batches), 128 (512 KB) above (prefill: each block's A rows are read in strips of a slice's width, and C goes
// in and out of the tiles once per slice). Measured on the AMX Xeon (bench kernels, bf16, 2 threads, us; whole-
// panel passes / slices of 8 / 32 / 64 steps): Mixtral's down 17 rows 7,630 / 5,004 / 4,807 / 5,023, 64 rows
// 16,224 / 7,967 / 7,490 / 7,737; gate_up 64 rows 19,426 / 13,476 / 13,919 / 14,604; mini's down 64 rows 616 /
// 506 / 498 / 494. At 512 rows (whole / 32 / 64 / 128): Mixtral's down 60,145 / 38,694 / 34,702 / 33,259, mini's
// 2,389 / 2,971 / 2,911 / 2,280.
constexpr int64_t kSliceSteps = 32;
constexpr int64_t kManyBlockSliceSteps = 128;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 C (rows x 16 x 4 bytes), 4 A (rows x 64 bytes), 5-7 B (16 x 64 bytes); with a_tiles = 2, 5 is a
// second A tile (int8's split activations) and 6-7 B.
void configure(int rows, int a_tiles = 1) {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = static_cast<uint8_t>(i < 4 + a_tiles ? rows : 16);
  }
  _tile_loadconfig(&c);
}

// The tile dot products: tdpbf16ps (bf16 pairs), tdpbusd (A u8, B s8: W8A8), tdpbsud (A s8, B u8: W4A8).
enum class TileDot : uint8_t { kBf16, kU8S8, kS8U8 };

// C += A . B on tiles; the tile numbers must be constants, hence macros.
#define MOEX_AMX_DOT_OF(KIND, C, A, B)                       \
  if constexpr ((KIND) == TileDot::kU8S8) _tile_dpbusd(C, A, B);  \
  else if constexpr ((KIND) == TileDot::kS8U8) _tile_dpbsud(C, A, B); \
  else _tile_dpbf16ps(C, A, B)
#define MOEX_AMX_DOT(C, A, B) MOEX_AMX_DOT_OF(kInt8 ? TileDot::kU8S8 : TileDot::kBf16, C, A, B)

// The L2 prefetch of a call's panels: a cursor that never passes `end` (this call's last byte) and, at a pass's
// i-th k step, is moved up to first + i * per_step (at most kMaxLinesPerStep lines at a time, so a far target
// does not flood the queue). The first pass over a slice reads it from memory and keeps the cursor kLead bytes
// ahead of its reads; later passes read the slice from L2 and spread the next slice's lines over their steps.
struct Prefetch {
  const char* cursor;
  const char* end;
  const char* first = nullptr;
  double per_step = 0;
  // The weight-only and W4A8 loops: a K group's codes from `from`, `bytes` of them, read over `steps` k steps; the
  // cursor is kept kLead ahead of them.
  void group(const char* from, int64_t bytes, int64_t steps) {
    first = from + kLead;
    per_step = static_cast<double>(bytes) / static_cast<double>(steps);
  }
  void step(int64_t i) {
    const char* target = std::min(first + static_cast<int64_t>(static_cast<double>(i) * per_step), end);
    for (int n = 0; n < kMaxLinesPerStep && cursor < target; ++n, cursor += 64) _mm_prefetch(cursor, _MM_HINT_T1);
  }
};

// C's four tiles start at zero (the first slice, s0 == 0) or at the sums the c rows hold from the slices before:
// tiles 0-1 at c01 (16 rows x 64 bytes each, row stride kPanel * 4), tiles 2-3 at c23 + second.
[[gnu::always_inline]] inline void zero_c() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
void start_c(int64_t s0, const uint8_t* c01, const uint8_t* c23, int64_t second) {
  if (s0 == 0) {
    zero_c();
    return;
  }
  _tile_loadd(0, c01, kPanel * 4);
  _tile_loadd(1, c01 + 64, kPanel * 4);
  _tile_loadd(2, c23 + second, kPanel * 4);
  _tile_loadd(3, c23 + second + 64, kPanel * 4);
}

// One k step of a full panel against the A tile in tile 4: B tiles of lanes 0-15 .. 48-63 from b (a k step's
// rows of 256 bytes) into C tiles 0-3.
template <TileDot kDot>
[[gnu::always_inline]] inline void dot_step_of(const uint8_t* b) {
  _tile_loadd(5, b, kLaneRowBytes);
  MOEX_AMX_DOT_OF(kDot, 0, 4, 5);
  _tile_loadd(6, b + 64, kLaneRowBytes);
  MOEX_AMX_DOT_OF(kDot, 1, 4, 6);
  _tile_loadd(7, b + 128, kLaneRowBytes);
  MOEX_AMX_DOT_OF(kDot, 2, 4, 7);
  _tile_loadd(5, b + 192, kLaneRowBytes);
  MOEX_AMX_DOT_OF(kDot, 3, 4, 5);
}
template <bool kInt8>
[[gnu::always_inline]] inline void dot_step(const uint8_t* b) {
  dot_step_of<kInt8 ? TileDot::kU8S8 : TileDot::kBf16>(b);
}

// C tiles 0-3 into rows [16][64] of 4-byte sums.
[[gnu::always_inline]] inline void store_c(void* c) {
  auto* out = static_cast<uint8_t*>(c);
  _tile_stored(0, out, kPanel * 4);
  _tile_stored(1, out + 64, kPanel * 4);
  _tile_stored(2, out + 128, kPanel * 4);
  _tile_stored(3, out + 192, kPanel * 4);
}

// The A tile (tile 4) of `rows` rows at x (ldx bytes apart) from byte k_byte on; a step that would read past a
// row's row_bytes takes the rows' tails, then zeros, from a_tail [16][64] (out of line: once per K at most).
[[gnu::noinline]] void load_a_tail(const uint8_t* x, int64_t ldx, int64_t row_bytes, int64_t k_byte, int rows,
                                   uint8_t* a_tail) {
  std::memset(a_tail, 0, kTileRows * kStepBytes);
  for (int r = 0; r < rows; ++r) std::memcpy(a_tail + r * kStepBytes, x + r * ldx + k_byte, row_bytes - k_byte);
  _tile_loadd(4, a_tail, kStepBytes);
}
[[gnu::always_inline]] inline void load_a(const uint8_t* x, int64_t ldx, int64_t row_bytes, int64_t k_byte,
                                          int64_t step_bytes, int rows, uint8_t* a_tail) {
  if (k_byte + step_bytes <= row_bytes) _tile_loadd(4, x + k_byte, ldx);
  else load_a_tail(x, ldx, row_bytes, k_byte, rows, a_tail);
}

// Up to 16 rows, k steps [s0, s1): c [rows][64] (4-byte elements) += x [rows][steps x 64 bytes] . panel [steps x
// 16 rows][256 bytes]. Tiles: C 0-3 (lanes 0-15 .. 48-63), A 4, B 5-7 (5 holds lanes 0-15, then 48-63).
template <bool kInt8>
void block16(const uint8_t* x, int64_t ldx, const uint8_t* panel, int64_t s0, int64_t s1, void* c,
             Prefetch& prefetch) {
  auto* out = static_cast<uint8_t*>(c);
  start_c(s0, out, out, 128);
  for (int64_t s = s0; s < s1; ++s) {
    _tile_loadd(4, x + s * kStepBytes, ldx);
    dot_step<kInt8>(panel + s * kStepPanelBytes);
    prefetch.step(s - s0);
  }
  store_c(out);
}

// 32 rows (two A tiles, rows x0 and x1), one half of the panel's lanes (32 lanes): c [rows][64] gains lanes
// 32 h .. 32 h + 31. Tiles: C 0-1 (x0 . lanes 0-15, 16-31 of the half), C 2-3 (x1 . the same), A 4-5, B 6-7. Each
// B tile is loaded once for 32 rows; the two halves read the panel's lines 0-1 and 2-3 of each 256-byte k row.
template <bool kInt8>
void block32_half(const uint8_t* x0, const uint8_t* x1, int64_t ldx, const uint8_t* panel, int64_t s0, int64_t s1,
                  int h, void* c0, void* c1, Prefetch& prefetch) {
  auto* out0 = static_cast<uint8_t*>(c0) + h * 128;
  auto* out1 = static_cast<uint8_t*>(c1) + h * 128;
  start_c(s0, out0, out1, 0);
  for (int64_t s = s0; s < s1; ++s) {
    const uint8_t* b = panel + s * kStepPanelBytes + h * 128;
    _tile_loadd(4, x0 + s * kStepBytes, ldx);
    _tile_loadd(6, b, kLaneRowBytes);
    MOEX_AMX_DOT(0, 4, 6);
    _tile_loadd(7, b + 64, kLaneRowBytes);
    MOEX_AMX_DOT(1, 4, 7);
    _tile_loadd(5, x1 + s * kStepBytes, ldx);
    MOEX_AMX_DOT(2, 5, 6);
    MOEX_AMX_DOT(3, 5, 7);
    prefetch.step(s - s0);
  }
  _tile_stored(0, out0, kPanel * 4);
  _tile_stored(1, out0 + 64, kPanel * 4);
  _tile_stored(2, out1, kPanel * 4);
  _tile_stored(3, out1 + 64, kPanel * 4);
}
#undef MOEX_AMX_DOT
#undef MOEX_AMX_DOT_OF

template <bool kInt8>
void run_panels(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const uint8_t*>(job.activations);  // [T][k_padded] bf16 or u8 (q + 128)
  const int64_t tokens = job.tokens, elem = kInt8 ? 1 : 2, ldx = w.k_padded * elem;
  const int64_t steps = ldx / kStepBytes, panel_bytes = steps * 16 * kLaneRowBytes;
  thread_local std::vector<float> c;    // [T][64] f32 sums (bf16), or s32 sums (W8A8, read only by intrinsics)
  thread_local std::vector<float> f;    // [T][64] W8A8's scaled sums
  if (c.size() < static_cast<size_t>((tokens + kTileRows) * kPanel)) {
    c.resize((tokens + kTileRows) * kPanel);  // and 16 rows for the last block's sums (below)
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
    // Passes over the panel: two blocks (17-32 rows) as two 32-row lane halves, each B tile loaded once for both
    // (the fused pass at decode batch 64 gives many experts 17-20 rows). More blocks run one by one: pairing them
    // too was slower for down (K = 3584: the A tiles of 32 rows come from L2 twice per k step).
    const int64_t pairs = blocks == 2 ? 1 : 0, passes = pairs * 2 + (blocks - pairs * 2);
    const int64_t slice = passes == 1 ? steps : blocks > 4 ? kManyBlockSliceSteps : kSliceSteps;
    // A last block overlapping the one before it (3+ blocks, T not a multiple of 16) keeps its sums apart until
    // the panel is done: between slices, the block before has already added this slice to the shared rows.
    const bool last_apart = pairs == 0 && passes > 1 && tokens % kTileRows != 0 && steps > 0;
    float* last_c = last_apart ? c.data() + tokens * kPanel : c.data() + (tokens - rows) * kPanel;
    for (int64_t s0 = 0; s0 < steps; s0 += slice) {
      const int64_t s1 = std::min(steps, s0 + slice);
      for (int64_t p = 0; p < passes; ++p) {
        const auto* slice_begin = reinterpret_cast<const char*>(w_panel + s0 * kStepPanelBytes);
        const int64_t slice_bytes = (s1 - s0) * kStepPanelBytes;
        if (p == 0) {
          prefetch.first = slice_begin + kStepPanelBytes + kLead;
          prefetch.per_step = kStepPanelBytes;
        } else {  // the next slice (of this panel or the next), spread over passes 1..
          prefetch.per_step = static_cast<double>(kStepPanelBytes) / static_cast<double>(passes - 1);
          prefetch.first = slice_begin + slice_bytes + static_cast<int64_t>(((p - 1) * (s1 - s0) + 1) * prefetch.per_step);
        }
        if (p < pairs * 2) {
          const int64_t t0 = (p / 2) * 2 * kTileRows, t1 = std::min(t0 + kTileRows, tokens - rows);
          block32_half<kInt8>(x + t0 * ldx, x + t1 * ldx, ldx, w_panel, s0, s1, static_cast<int>(p % 2),
                              c.data() + t0 * kPanel, c.data() + t1 * kPanel, prefetch);
        } else {
          const int64_t t = std::min(p * kTileRows, tokens - rows);  // the last block, alone
          block16<kInt8>(x + t * ldx, ldx, w_panel, s0, s1, p + 1 == passes ? last_c : c.data() + t * kPanel,
                         prefetch);
        }
      }
    }
    if (last_apart) std::memcpy(c.data() + (tokens - rows) * kPanel, last_c, rows * kPanel * sizeof(float));
    if constexpr (kInt8) {
      w8a8_panel_to_f32(job, panel, reinterpret_cast<const int32_t*>(c.data()), f.data());
      apply_epilogue(job.epilogue, w, panel, tokens, f.data());
    } else {
      apply_epilogue(job.epilogue, w, panel, tokens, c.data());
    }
  }
  if (steps > 0) _tile_release();
}

// The weight-only formats whose activations are bf16 (fp8: e4m3 codes, one scale per 128 k of a panel; int4:
// codes 0..15, a scale and an offset per `group` k of a lane, w = q * scale + offset): tdpbf16ps over the codes
// decoded to bf16 pairs, one K group (the scales' block) at a time. Per panel and group the codes are decoded
// once (at most 16 KB, L1) and every 16-row block runs the group's k steps over them from zeroed C, then folds C
// into its f32 rows: fp8 adds C times the group's scale; int4 adds C times the scale plus the offset times the
// row's sum of the group's activations (job.group_sums: w = q * scale + offset, summed over the group). That is
// each few-row loop's grouping; within a group tdpbf16ps adds a k pair in another order than vdpbf16ps (and
// int4's few-row loop multiplies by q + 16), so the loops differ in last bits. The activations are the few-row
// loops' bf16 rows [T][k_padded] (k_padded = K rounded to 2): a last k step that would read past a row's end
// takes its A tile from a zero-padded copy. int8 (weight-only, one scale per lane) keeps ~16 bits of each f32
// activation: its rows are split into two bf16 planes, hi = x rounded to bf16 and lo = the rest rounded
// (split_row_bf16_avx512bf16: relative error <= 2^-17, within the f32 path's tolerance; rounding to bf16 alone
// would change int8's results by ~2^-9), and every B tile of the decoded codes is loaded once for two dot
// products, hi's and lo's, into the same C: twice a bf16 row's tile work, the decode and B loads of one.
constexpr int64_t kMaxGroup = 128;

// int4's codes of one panel's pair rows [j0, j0 + pairs) (a lane's byte: q(2j) low nibble, q(2j + 1) high) as bf16
// pairs in bf16's packed layout; rows past `valid` zero. The codes are small integers: exact in bf16, looked up
// in a table of 16 words (vpermw) by a dword per lane whose low word is the low nibble and high word the high one.
void decode_int4_pairs(const uint8_t* codes, int64_t valid, int64_t pairs, uint16_t* out) {
  alignas(64) static const uint16_t kBf16Of[32] = {
      0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150,
      0x4160, 0x4170};  // (words 16-31 never indexed)
  const __m512i table = _mm512_load_si512(kBf16Of), nibbles = _mm512_set1_epi32(0x000f000f);
  for (int64_t j = 0; j < pairs; ++j) {
    for (int c = 0; c < 4; ++c) {  // lanes 16c .. 16c + 15
      __m512i pair = _mm512_setzero_si512();
      if (j < valid) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + j * kPanel + 16 * c)));
        // (b | b << 12) & 0x000f000f: the high nibble moves to bits 16-19 (0xa8: (A | B) & C)
        const __m512i index = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), nibbles, 0xa8);
        pair = _mm512_permutexvar_epi16(index, table);
      }
      _mm512_store_si512(out + j * 2 * kPanel + 32 * c, pair);
    }
  }
}

// int8's codes of one panel's k rows [0, valid) ([K][64] bytes) as bf16 pairs (w(2j), w(2j + 1)) in bf16's packed
// layout, `pairs` pair rows; k rows past `valid` zero. The codes (|q| <= 128) are exact in bf16: the top half of
// their f32, whose low half is zero, so a pair is f32(w(2j + 1)) | f32(w(2j)) >> 16.
void decode_int8_pairs(const uint8_t* codes, int64_t valid, int64_t pairs, uint16_t* out) {
  const auto f32_bits = [&](int64_t k, int c) {
    if (k >= valid) return _mm512_setzero_si512();
    const __m512i q = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + k * kPanel + 16 * c)));
    return _mm512_castps_si512(_mm512_cvtepi32_ps(q));
  };
  for (int64_t j = 0; j < pairs; ++j)
    for (int c = 0; c < 4; ++c)  // lanes 16c .. 16c + 15
      _mm512_store_si512(out + j * 2 * kPanel + 32 * c,
                         _mm512_or_si512(f32_bits(2 * j + 1, c), _mm512_srli_epi32(f32_bits(2 * j, c), 16)));
}

template <WeightFormat kFormat>
void weight_only_panels(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  constexpr bool kFp8 = kFormat == WeightFormat::kFP8E4M3, kInt8 = kFormat == WeightFormat::kInt8;
  constexpr int64_t kPerStep = kStepBytes / 2;  // k per step: an A tile row holds 32 bf16
  const PackedWeights& w = *job.w;
  // [T][k_padded] bf16; int8 [T][split_row_stride(K)]: the hi plane [split_plane(K)], then the lo plane
  const auto* x = static_cast<const uint8_t*>(job.activations);
  const int64_t tokens = job.tokens, K = w.cols, row_bytes = (kInt8 ? split_plane(K) : w.k_padded) * 2;
  const int64_t ldx = kInt8 ? split_row_stride(K) * 2 : row_bytes;  // bytes from one row to the next
  // The K group: fp8's scale block; int4's group; int8 (one scale per lane) 128 k, as fp8's.
  const int64_t group = kFp8 || kInt8 ? kMaxGroup : w.group, groups = (K + group - 1) / group;
  thread_local std::vector<float> acc;  // [T][64] the panel's folded sums
  if (acc.size() < static_cast<size_t>(tokens * kPanel)) acc.resize(tokens * kPanel);
  alignas(64) uint16_t decoded[kMaxGroup / 2 * kPanel * 2];  // [group / 2 pairs][64 lanes][2]: one group, <= 16 KB
  alignas(64) float part[kTileRows * kPanel];                  // one block's group sums [16][64]
  alignas(64) uint8_t a_tail[kTileRows * kStepBytes];          // a last k step's A rows, zero-padded
  const int rows = static_cast<int>(std::min<int64_t>(tokens, kTileRows));
  const int64_t blocks = (tokens + kTileRows - 1) / kTileRows;
  if (K > 0) configure(rows, kInt8 ? 2 : 1);
  // The codes of this call's panels are one run of memory, read group by group: the L2 prefetch keeps kLead bytes
  // ahead of the decode (without it the decode waits on every group's lines: mini's gate_up at 16 rows took as
  // long at any row count, ~32% of the read probe).
  const int64_t code_bytes_per_k = kFormat == WeightFormat::kInt4 ? kPanel / 2 : kPanel;
  const int64_t panel_code_bytes = (kFormat == WeightFormat::kInt4 ? w.k_padded : K) * code_bytes_per_k;
  const auto* all_codes = reinterpret_cast<const char*>(w.data.as<const uint8_t>());
  Prefetch prefetch{all_codes + panel_begin * panel_code_bytes, all_codes + panel_end * panel_code_bytes};
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    // fp8 and int8 [K][64] codes; int4 [k_padded / 2][64] bytes of two codes
    const uint8_t* codes = w.data.as<const uint8_t>() + panel * (kFp8 || kInt8 ? K : w.k_padded / 2) * kPanel;
    // [G][64] (fp8: times 2^8); int8 [64], the same for every group
    const float* scales = w.scales.as<const float>() + panel * (kInt8 ? 1 : groups) * kPanel;
    const int64_t scale_stride = kInt8 ? 0 : kPanel;
    const float* offsets = kFormat != WeightFormat::kInt4 ? nullptr : w.offsets.as<const float>() + panel * groups * kPanel;  // [G][64]
    std::fill_n(acc.begin(), tokens * kPanel, 0.0f);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * group, kn = std::min(group, K - k0), steps = (kn + kPerStep - 1) / kPerStep;
      // Spread over the group's k steps of every block: a burst of a group's lines waits on the line fill buffers.
      prefetch.group(all_codes + panel * panel_code_bytes + k0 * code_bytes_per_k, kn * code_bytes_per_k, steps * blocks);
      int64_t step_index = 0;
      if constexpr (kFp8) decode_fp8_pairs_avx512bf16vbmi(codes + k0 * kPanel, kn, steps * 16, decoded);
      else if constexpr (kInt8) decode_int8_pairs(codes + k0 * kPanel, kn, steps * 16, decoded);
      else decode_int4_pairs(codes + k0 / 2 * kPanel, (kn + 1) / 2, steps * 16, decoded);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t t = std::min(b * kTileRows, tokens - rows);  // the last block ends at row T - 1
        zero_c();
        for (int64_t s = 0; s < steps; ++s) {
          // This step's k; its A tile reads k .. k + kPerStep - 1 of each row (zeros past a row's end, where the
          // weights are zero too).
          const int64_t k = k0 + kPerStep * s;
          const auto* bk = reinterpret_cast<const uint8_t*>(decoded) + s * kStepPanelBytes;
          if constexpr (kInt8) {  // the planes are zero-padded to whole steps: no tail
            _tile_loadd(4, x + t * ldx + k * 2, ldx);              // hi
            _tile_loadd(5, x + t * ldx + row_bytes + k * 2, ldx);  // lo
            _tile_loadd(6, bk, kLaneRowBytes);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, bk + 64, kLaneRowBytes);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(0, 5, 6);
            _tile_dpbf16ps(1, 5, 7);
            _tile_loadd(6, bk + 128, kLaneRowBytes);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, bk + 192, kLaneRowBytes);
            _tile_dpbf16ps(3, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          } else {
            load_a(x + t * ldx, ldx, row_bytes, k * 2, kStepBytes, rows, a_tail);
            dot_step<false>(bk);
          }
          prefetch.step(++step_index);
        }
        store_c(part);
        // A last block overlapping the one before adds only its rows the blocks before did not.
        for (int64_t r = b * kTileRows - t; r < rows; ++r) {
          constexpr bool kInt4 = kFormat == WeightFormat::kInt4;
          const __m512 sum = kInt4 ? _mm512_set1_ps(job.group_sums[(t + r) * groups + g]) : _mm512_setzero_ps();
          for (int v = 0; v < 4; ++v) {
            float* out = acc.data() + (t + r) * kPanel + 16 * v;
            __m512 y = _mm512_fmadd_ps(_mm512_load_ps(part + r * kPanel + 16 * v),
                                       _mm512_loadu_ps(scales + g * scale_stride + 16 * v), _mm512_loadu_ps(out));
            if constexpr (kInt4) y = _mm512_fmadd_ps(sum, _mm512_loadu_ps(offsets + g * kPanel + 16 * v), y);
            _mm512_storeu_ps(out, y);
          }
        }
      }
    }
    apply_epilogue(job.epilogue, w, panel, tokens, acc.data());
  }
  if (K > 0) _tile_release();
}

// W4A8 (int4 codes x s8 activation codes, a scale per token and K group) on int8 tiles: tdpbsud (A signed: the
// activation codes; B unsigned: the weight codes 0..15). Per panel and K group the nibbles are split into u8 quads
// in W8A8's panel layout (a k8 row of 64 lanes x 4 bytes -> its low nibbles, the quad 8j.., and its high ones, the
// quad 8j + 4..: two ANDs and a shift per 64 bytes, far cheaper than the bf16 decode above), every 16-row block
// sums the group's k steps from zeroed C in integers (exact), and the sums fold in with the VNNI loop's own
// operations in its order (packed_w4a8_avx512vnni.cc: xs_g * (scale_g * sum + offset_g * sum_g(xq)), group by
// group from zero), so a row's result is the few-row loop's to the bit. A group of 32 runs 32-k steps (the A tile
// 32 bytes wide, B tiles 8 quad rows).
void decode_w4a8_quads(const uint8_t* k8_rows, int64_t valid, int64_t pairs, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t j = 0; j < pairs; ++j) {  // k8 row j -> quad rows 2j (low nibbles) and 2j + 1 (high nibbles)
    for (int v = 0; v < 4; ++v) {
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      if (j < valid) {
        const __m512i b = _mm512_load_si512(k8_rows + j * kLaneRowBytes + 64 * v);
        lo = _mm512_and_si512(b, low);
        hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
      }
      _mm512_store_si512(out + 2 * j * kLaneRowBytes + 64 * v, lo);
      _mm512_store_si512(out + (2 * j + 1) * kLaneRowBytes + 64 * v, hi);
    }
  }
}

void w4a8_panels(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  const PackedWeights& w = *job.w;
  const auto* x = static_cast<const uint8_t*>(job.activations);  // [T][k_padded] s8 codes, zero tail
  const int64_t tokens = job.tokens, K = w.cols, kp = w.k_padded, group = w.group, groups = (K + group - 1) / group;
  const int64_t step_k = std::min<int64_t>(group, kStepBytes);  // k per tdpbsud: 64, or a group of 32
  thread_local std::vector<float> acc;  // [T][64] the panel's folded sums
  if (acc.size() < static_cast<size_t>(tokens * kPanel)) acc.resize(tokens * kPanel);
  alignas(64) uint8_t decoded[kMaxGroup / 4 * kLaneRowBytes];  // [group / 4 quad rows][64 lanes][4]: <= 8 KB
  alignas(64) int32_t part[kTileRows * kPanel];                 // one block's group sums [16][64]
  alignas(64) uint8_t a_tail[kTileRows * kStepBytes];           // a last k step's A rows, zero-padded
  const int rows = static_cast<int>(std::min<int64_t>(tokens, kTileRows));
  const int64_t blocks = (tokens + kTileRows - 1) / kTileRows;
  if (K > 0) {  // A: rows x step_k bytes; B: step_k / 4 quad rows x 64 bytes; C: rows x 16 s32
    TileConfig c;
    for (int i = 0; i < 8; ++i) {
      c.colsb[i] = static_cast<uint16_t>(i == 4 ? step_k : 64);
      c.rows[i] = static_cast<uint8_t>(i < 5 ? rows : step_k / 4);
    }
    _tile_loadconfig(&c);
  }
  const int64_t panel_code_bytes = kp / 2 * kPanel;  // [kp / 8][64][4]
  const auto* all_codes = reinterpret_cast<const char*>(w.data.as<const uint8_t>());
  Prefetch prefetch{all_codes + panel_begin * panel_code_bytes, all_codes + panel_end * panel_code_bytes};
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    const uint8_t* codes = w.data.as<const uint8_t>() + panel * panel_code_bytes;
    const float* scales = w.scales.as<const float>() + panel * groups * kPanel;    // [G][64]
    const float* offsets = w.offsets.as<const float>() + panel * groups * kPanel;  // [G][64]
    std::fill_n(acc.begin(), tokens * kPanel, 0.0f);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * group, kn = std::min(group, K - k0), steps = (kn + step_k - 1) / step_k;
      prefetch.group(all_codes + panel * panel_code_bytes + k0 / 2 * kPanel, kn / 2 * kPanel, steps * blocks);
      int64_t step_index = 0;
      decode_w4a8_quads(codes + k0 / 2 * kPanel, (kn + 7) / 8, steps * step_k / 8, decoded);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t t = std::min(b * kTileRows, tokens - rows);  // the last block ends at row T - 1
        zero_c();
        for (int64_t s = 0; s < steps; ++s) {
          // k_padded is K rounded to 8: a last step may read past it (zeros)
          load_a(x + t * kp, kp, kp, k0 + step_k * s, step_k, rows, a_tail);
          dot_step_of<TileDot::kS8U8>(decoded + s * (step_k / 4) * kLaneRowBytes);
          prefetch.step(++step_index);
        }
        store_c(part);
        // The VNNI loop's fold, operation for operation; a last block overlapping the one before adds only its
        // new rows.
        for (int64_t r = b * kTileRows - t; r < rows; ++r) {
          const __m512 code_sum = _mm512_set1_ps(job.group_sums[(t + r) * groups + g]);
          const __m512 act_scale = _mm512_set1_ps(job.token_scales[(t + r) * groups + g]);
          for (int v = 0; v < 4; ++v) {
            float* out = acc.data() + (t + r) * kPanel + 16 * v;
            const __m512 group_sum =
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(part + r * kPanel + 16 * v)),
                                _mm512_loadu_ps(scales + g * kPanel + 16 * v),
                                _mm512_mul_ps(_mm512_loadu_ps(offsets + g * kPanel + 16 * v), code_sum));
            _mm512_storeu_ps(out, _mm512_fmadd_ps(group_sum, act_scale, _mm512_loadu_ps(out)));
          }
        }
      }
    }
    apply_epilogue(job.epilogue, w, panel, tokens, acc.data());
  }
  if (K > 0) _tile_release();
}

}  // namespace

void run_panels_int4_w4a8_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  w4a8_panels(job, panel_begin, panel_end);
}

void run_panels_fp8_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  weight_only_panels<WeightFormat::kFP8E4M3>(job, panel_begin, panel_end);
}

void run_panels_int8_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  weight_only_panels<WeightFormat::kInt8>(job, panel_begin, panel_end);
}

void run_panels_int4_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  weight_only_panels<WeightFormat::kInt4>(job, panel_begin, panel_end);
}

void run_panels_bf16_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  run_panels<false>(job, panel_begin, panel_end);
}

void run_panels_w8a8_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end) {
  run_panels<true>(job, panel_begin, panel_end);
}

}  // namespace moex::kernels::x86
