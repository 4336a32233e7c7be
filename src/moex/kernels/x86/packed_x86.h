// The x86 halves of kernels/packed.h: declarations only (no intrinsics), so the dispatcher in packed.cc,
// compiled for the baseline ISA, can call them. Each function lives in a file whose suffix names its ISA.
#pragma once
#include <cstdint>

#include "moex/kernels/packed.h"

namespace moex::kernels::x86 {

// What happens to a panel's results c [tokens][64] once its K is done.
struct Epilogue {
  enum Kind : uint8_t { kStore, kAccumulate, kSiluMul, kRoutedAccumulate } kind = kStore;
  float* y = nullptr;  // kStore/kAccumulate/kSiluMul: y [T, ld_y]; kRoutedAccumulate: y[out_rows[t] * ld_y + n]
  int64_t ld_y = 0;
  const float* route_weights = nullptr;  // [T]
  const int32_t* out_rows = nullptr;     // [T]
};

// One call's work: activations as the format's kernel reads them, split by panels [panel_begin, panel_end).
struct PanelJob {
  const void* activations = nullptr;  // bf16 u16 [T][k_padded] | f32 [T][cols] | W8A8 u8 (q + 128) [T][k_padded]
                                      // | W8A8 / W4A8 on AVX2 and W4A8 on VNNI: s8 q [T][k_padded]
  const float* token_scales = nullptr;  // W8A8: [T] activation scales; W4A8: [T][groups], one per token and K group;
                                        // int8 on VNNI: [T][int8_activation_groups(K)]
  const float* group_sums = nullptr;    // int4 on BF16 and AVX2: [T][groups] sums of the bf16 activations per K group;
                                        // W4A8: [T][groups] sums of the s8 activation codes per K group
  int64_t tokens = 0;
  bool many_rows = false;  // the many-row loop (the weight's KernelChoice decides, kernels/formats.h), else the few-row one
  const PackedWeights* w = nullptr;
  Epilogue epilogue;
};

// The epilogue in plain C++ (defined in packed.cc): the scalar path's, and the AVX2 kernels' (its silu's
// std::exp costs little next to a K-long dot product per output).
void apply_epilogue_scalar(const Epilogue& e, const PackedWeights& w, int64_t panel, int64_t tokens, const float* c);
// bf16 / int8 / int4 / fp8 on AVX2 + FMA (cpu_features().has_avx2_kernels()), x86/packed_weight_only_avx2.cc.
void run_panels_weight_only_avx2(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
// W8A8 / W4A8 on AVX2 with vpmaddubsw (s8 activation codes, exact sums), x86/packed_w8a8_avx2.cc, packed_w4a8_avx2.cc.
void run_panels_w8a8_avx2(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
void run_panels_int4_w4a8_avx2(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
void run_panels_bf16_avx512bf16(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
// The many-row GEMMs (the registry's kManyRows rows, kernels/formats.cc), in x86/expert_gemm_*.cc.
void run_panels_bf16_many_avx512bf16(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
void run_panels_w8a8_many_avx512vnni(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
// int4 (weight-only) x bf16 activations through vdpbf16ps (both row loops; the decode uses VBMI),
// x86/packed_int4_avx512bf16vbmi.cc; the caller has checked has_avx512_bf16_vbmi_kernels().
void run_panels_int4_avx512bf16vbmi(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
// fp8 e4m3 x bf16 activations through byte tables and vdpbf16ps (both row loops), x86/packed_fp8_avx512bf16vbmi.cc;
// the caller has checked has_avx512_bf16_vbmi_kernels().
void run_panels_fp8_avx512bf16vbmi(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
// codes [k_count][64] (a panel's e4m3 rows from some k on) -> out [pair_rows][64][2] bf16 pairs (k 2j, 2j + 1 of
// every lane, lane order: bf16's packed layout; the values times 2^-8 as the fp8 scales expect; k at or past
// k_count zero). out 64-byte aligned. For the AMX fp8 kernel (expert_gemm_amx.cc), which cannot use VBMI.
void decode_fp8_pairs_avx512bf16vbmi(const uint8_t* codes, int64_t k_count, int64_t pair_rows, uint16_t* out);
// fp8 and int4 (weight-only) many rows on AMX tiles: each K group decoded once per panel to bf16 pairs (fp8 through
// the table above), tdpbf16ps per 16-row block, the group's sums folded in with its scale (and int4's offset times
// job.group_sums) into f32 rows; x86/expert_gemm_amx.cc.
void run_panels_fp8_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
// int8 (weight-only) likewise, over activations split into two bf16 planes, hi and lo (split_row_bf16_avx512bf16),
// each against the codes as bf16 pairs: x . w to ~16 bits of x, the f32 path's result within its tolerance.
void run_panels_int8_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
void run_panels_int4_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
// W4A8 many rows on AMX int8 tiles (tdpbsud over the nibbles split into u8 quads per K group), folded as the VNNI
// loop folds: the same bits; x86/expert_gemm_amx.cc.
void run_panels_int4_w4a8_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
// The many-row GEMMs on AMX tiles (bf16 and W8A8), x86/expert_gemm_amx.cc: the caller has checked
// has_amx_kernels() and request_amx_permission().
void run_panels_bf16_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
void run_panels_w8a8_amx(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
void run_panels_weight_only_avx512(const PanelJob& job, int64_t panel_begin, int64_t panel_end);  // int8/int4/fp8
// int8 (weight-only) x s16 activation codes per token and K group through vpdpwssd, on VNNI CPUs without AMX (both
// row loops, the same bits), x86/packed_int8_avx512vnni.cc. Its activations: quantize_row_s16_avx512.
void run_panels_int8_avx512vnni(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
inline constexpr int64_t kInt8ActivationGroup = 128;  // k per activation scale (and per exact integer sum)
inline int64_t int8_activation_groups(int64_t k) { return (k + kInt8ActivationGroup - 1) / kInt8ActivationGroup; }
// A row of s16 codes: K rounded up to 32 (64-byte rows; a k pair never reads past its row), zero tail.
inline int64_t int8_activation_stride(int64_t k) { return (k + 31) / 32 * 32; }
// x [k] -> out [int8_activation_stride(k)] s16 codes, scales [int8_activation_groups(k)]: per K group of
// kInt8ActivationGroup, scale = absmax / 32767, q = round-to-nearest-even(x * (32767 / absmax)) within +-32767.
void quantize_row_s16_avx512(const float* x, int64_t k, int16_t* out, float* scales);
void run_panels_w8a8_avx512vnni(const PanelJob& job, int64_t panel_begin, int64_t panel_end);
// int4 codes x s8 activations (kInt4W4A8): one loop for every row count, in x86/packed_w4a8_avx512vnni.cc.
void run_panels_int4_w4a8_avx512vnni(const PanelJob& job, int64_t panel_begin, int64_t panel_end);

// x [k] f32 -> out [k_padded] bf16 (round to nearest even, zero tail).
void round_row_bf16_avx512bf16(const float* x, int64_t k, int64_t k_padded, uint16_t* out);
// x [k] f32 -> hi [k_padded], lo [k_padded] bf16 (zero tails): hi = x rounded to bf16, lo = what is left, rounded
// to bf16, so hi + lo is x to ~16 bits (relative error <= 2^-17). int8's tiles read both planes against its codes.
void split_row_bf16_avx512bf16(const float* x, int64_t k, int64_t k_padded, uint16_t* hi, uint16_t* lo);
// A plane's length: K rounded to a tile step (32 bf16), so no step reads past it.
inline int64_t split_plane(int64_t k) { return (k + 31) / 32 * 32; }
// A split row's stride in bf16 elements: its two planes and 64 bytes more, so a tile's 16 rows do not fall in one
// L1 set (K = 1024: 4 KB apart without it, and the A tile loads missed L1).
inline int64_t split_row_stride(int64_t k) { return 2 * split_plane(k) + 32; }
// x [k] -> out [k_padded] u8 = quantize_activations_s8 + 128 (zero tail: 128); returns the scale.
float quantize_row_u8_avx512(const float* x, int64_t k, int64_t k_padded, uint8_t* out);
// out[i] = f32_to_f8e4m3(x[i] / scale) for i < n, the same codes (quantize_fp8's loop).
void f32_to_f8e4m3_row_avx512(const float* x, int64_t n, float scale, uint8_t* out);

}  // namespace moex::kernels::x86
