// Weight formats beyond the checkpoint's own bf16/f32, and the matmuls and fused expert pieces over them.
//
// Two forms of one weight matrix W [rows, cols] (HF [out, in] orientation):
//   QuantizedMatrix  natural row-major layout: what a checkpoint stores, what quantize_* returns and what
//                    the scalar references in ref:: read (the test oracle);
//   PackedWeights    the same numbers repacked once for the fast kernels: output channels in panels of
//                    kPanel = 64 rows (four 16-lane vectors), each panel's K run contiguous so a thread
//                    streams its panels front to back. Per-channel / per-group scales are laid out per
//                    panel lane so the kernels read them as vectors.
// All kernels compute y[T, N] = x[T, K] @ W^T with x and y in f32; what differs is how W is stored and
// which dot-product instruction reads it (see WeightFormat).
#pragma once
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "moex/base/cpu.h"
#include "moex/base/tensor.h"
#include "moex/kernels/formats.h"

namespace moex::kernels {


// W in natural layout. Only the members of its format are filled.
struct QuantizedMatrix {
  WeightFormat format = WeightFormat::kBF16;
  int64_t rows = 0, cols = 0;
  int64_t group = 0;            // int4: codes per scale along K (32, 64, 128); fp8: 128; else 0
  std::vector<uint16_t> bf16;   // kBF16: [rows, cols]
  std::vector<uint8_t> codes;   // kInt8*: s8 bytes; kInt4*: 0..15 one per byte; kFP8E4M3: e4m3 — all [rows, cols]
  std::vector<float> scales;    // kInt8*: [rows]; kInt4*: [rows, groups()]; kFP8E4M3: [ceil(rows/128), groups()]
  std::vector<uint8_t> zeros;   // kInt4*: [rows, groups()] (8 everywhere when symmetric)

  int64_t groups() const { return group ? (cols + group - 1) / group : 1; }
  float weight(int64_t r, int64_t c) const;  // the dequantized value, as the references use it
};

// From f32 or bf16 W [rows, cols] (any row stride).
QuantizedMatrix quantize_bf16(const TensorView& w);
// Symmetric per row: scale = absmax / 127, q = round(w / scale). format: kInt8 or kInt8W8A8.
QuantizedMatrix quantize_int8(const TensorView& w, WeightFormat format = WeightFormat::kInt8);
// Per row and group of `group` columns (32, 64 or 128). Symmetric: zero 8, scale = absmax / 7 (codes 1..15);
// asymmetric: scale = (max - min) / 15, zero = round(-min / scale) clamped to 0..15. format: kInt4 or kInt4W4A8.
QuantizedMatrix quantize_int4(const TensorView& w, int64_t group, bool symmetric,
                              WeightFormat format = WeightFormat::kInt4);
// Per 128x128 block: scale = absmax / 448, code = e4m3(w / scale).
QuantizedMatrix quantize_fp8(const TensorView& w);
// The quantizer `--weights` / `--dense-weights` run at load for `format` (its file's, kernels/formats/): bf16
// rounding, int8 per row, int4 symmetric per group of `group` along K, fp8 per 128x128 block.
QuantizedMatrix quantize(const TensorView& w, WeightFormat format, int64_t group);
// The same with int4's zero point chosen (symmetric false: asymmetric; other formats ignore it): tests, benchmarks.
QuantizedMatrix quantize(const TensorView& w, WeightFormat format, int64_t group, bool symmetric);
// A checkpoint's FP8 tensor as is: codes F8_E4M3 [rows, cols], scale_inv F32 [ceil(rows/128), ceil(cols/128)].
QuantizedMatrix fp8_from_checkpoint(const TensorView& codes, const TensorView& scale_inv);

constexpr int64_t kPanel = 64;  // output channels per panel: four 16-lane vectors of f32 accumulators

// 64-byte aligned bytes (the panels are read with full-width vector loads): an allocation of their own, or a
// slice of a WeightArena that the slice keeps alive.
struct AlignedBytes {
  std::shared_ptr<uint8_t> ptr;
  size_t size = 0;
  void allocate(size_t bytes);  // zero-filled; from 4 MB the 2 MB-aligned interior is advised for huge pages
  template <typename T>
  T* as() const { return reinterpret_cast<T*>(ptr.get()); }
};

// W repacked for the kernels. Layouts by format (P = panels, G = ceil(cols / group), lanes = 64):
//   kBF16      data u16 [P][k_padded/2][64][2]  (VNNI pairs: a 32-bit lane holds W[n][k], W[n][k+1]);
//              k_padded a multiple of 32, so AMX B tiles (16 pairs) never run past a panel
//   kInt8      data s8  [P][cols][64];          scales [P][64]
//   kInt8W8A8  data s8  [P][k_padded/4][64][4]; scales [P][64]; col_sums i32 [P][64] (sum over k of q);
//              k_padded a multiple of 64, one AMX A tile row of u8 (bf16's 32 is its 64 bytes)
//   kInt4      data u8  [P][k_padded/2][64] (a lane's byte: q(k) low nibble, q(k+1) high); scales, offsets
//              [P][G][64] with w = q * scale + offset (offset = -zero * scale)
//   kInt4W4A8  data u8  [P][k_padded/8][64][4] (a lane's 32 bits hold 8 k: byte b has q(8j+b) low, q(8j+4+b)
//              high, so masking gives the k quad 8j.. and a shift the quad 8j+4..); scales, offsets as kInt4
//   kFP8E4M3   data u8  [P][cols][64];          scales [P][G=ceil(cols/128)][64], times 2^8 (the kernels read
//              an e4m3 code as fp16 bits, or as a bf16 table entry, both 2^-8 of its value); k_padded =
//              round_up(cols, 2), the length of the bf16 activation rows (k pairs)
// gate_up: rows counts outputs of silu(x w1^T) * (x w3^T); panel p's lanes 0..31 hold rows 32p.. of w1 and
// lanes 32..63 the same rows of w3, so one pass over the panel yields both halves of 32 outputs.
// Padding lanes and padded k have zero weight.
struct PackedWeights {
  WeightFormat format = WeightFormat::kBF16;
  int64_t rows = 0, cols = 0, group = 0;
  bool gate_up = false;
  int64_t panels = 0, k_padded = 0;
  AlignedBytes data, scales, offsets, col_sums;
  // Which kernels run it, resolved once by packed_layout (pack, pack_gate_up and mapped panels all start there):
  // the calls read it and decide nothing but the row regime (KernelChoice::for_rows).
  KernelChoice kernel;

  int64_t rows_per_panel() const { return gate_up ? kPanel / 2 : kPanel; }
  size_t weight_bytes() const;  // bytes a pass over W reads (codes + scales): the roofline's numerator

  // The buffers by index (0 data, 1 scales, 2 offsets, 3 col_sums), and whether `format` has buffer b (the
  // layouts below): what pack() allocates and what a file of packed panels holds.
  static constexpr int kBuffers = 4;
  static bool has_buffer(WeightFormat format, int b) { return (format_traits(format).buffers >> b) & 1; }
  AlignedBytes& buffer(int b) { return b == 0 ? data : b == 1 ? scales : b == 2 ? offsets : col_sums; }
  const AlignedBytes& buffer(int b) const { return const_cast<PackedWeights*>(this)->buffer(b); }
};

// The geometry pack() gives W [rows, cols] in `format` (panels, k_padded, and each buffer's size in bytes), with
// no buffers allocated: what a file of packed panels must hold for it (model/panels_file.h).
PackedWeights packed_layout(WeightFormat format, int64_t rows, int64_t cols, int64_t group, bool gate_up);
// Bump when any layout above changes: files of packed panels written by an earlier version are then refused.
inline constexpr int kPackedLayoutVersion = 1;

PackedWeights pack(const QuantizedMatrix& w);
// bf16's packing straight from a view (model/weights.h's pack_bf16_direct: a load's --weights bf16): panel `panel` of
// p (packed_layout(kBF16, ...), data allocated, not necessarily zeroed) written from a (bf16 or f32 [rows, cols],
// rows may be strided) and, for a gate_up layout, b (w3, same shape and dtype), with no copy in between. Padding
// lanes and padded k are written as zeros: the bytes of pack(quantize_bf16(a)) / pack_gate_up.
void pack_bf16_panel(const TensorView& a, const TensorView* b, const PackedWeights& p, int64_t panel);
// w1, w3 [intermediate, hidden] of one expert, same format: the fused gate/up layout described above.
PackedWeights pack_gate_up(const QuantizedMatrix& w1, const QuantizedMatrix& w3);

// One allocation for many packed matrices (a MoE layer's experts), 2 MB aligned and advised for transparent
// huge pages (madvise MADV_HUGEPAGE; a hint, nothing fails without it). Why: at batch 1 a step reads a few
// experts chosen anew each step out of the whole model's, so on 4 KB pages nearly every page it reads misses
// the TLB with its page-table lines evicted by the streamed weights; with 128 small experts (qwen3-moe-mini,
// 2.3 GB) the fused pass streamed at 32-45% of the read probe on 4 KB pages and 82-105% on huge pages
// (docs/moe.md). adopt() copies a matrix's buffers in, in call order, so experts adopted in expert order lie
// in address order, and frees its old ones; the arena lives as long as any matrix in it.
class WeightArena {
 public:
  static size_t bytes_for(const PackedWeights& w);  // what adopt(w) takes: each buffer rounded up to 64 bytes
  void reserve(size_t bytes);                       // once, before the first adopt; zero-filled
  bool adopt(PackedWeights& w);                     // false (w keeps its own buffers) when it does not fit
  const uint8_t* base() const { return base_.get(); }
  size_t capacity() const { return capacity_; }

 private:
  std::shared_ptr<uint8_t> base_;
  size_t capacity_ = 0, used_ = 0;
};

// y [T, rows] (=, or += with accumulate) x [T, cols] @ W^T. Threads split the panels.
void packed_matmul(const float* x, int64_t tokens, const PackedWeights& w, float* y, bool accumulate = false,
                   bool batch_invariant = false);
// One of the matmuls of packed_matmul_group: y [T, w->rows] (=, or += with accumulate) x @ W^T.
struct PackedOutput {
  const PackedWeights* w = nullptr;
  float* y = nullptr;
  bool accumulate = false;
};
// Up to four packed matmuls of the same x [T, K] (attention's q, k and v) in ONE parallel region, x converted once,
// each output's numbers those of packed_matmul alone (same kernels, same panels). At decode the three regions of
// separate calls cost as much as streaming k or v. Outputs of different formats or K run one call each.
void packed_matmul_group(const float* x, int64_t tokens, const PackedOutput* outputs, int count,
                         bool batch_invariant = false);
// h [T, I] = silu(x [T, hidden] @ w1^T) * (x @ w3^T), w13 from pack_gate_up.
void expert_gate_up(const float* x, int64_t tokens, const PackedWeights& w13, float* h, bool batch_invariant = false);
// out[out_rows[t], 0:hidden] += route_weights[t] * (h [T, I] @ w2^T)[t]: the down projection of one expert's
// tokens, combined straight into their rows of the layer output (out_stride floats apart).
void expert_down_accumulate(const float* h, int64_t tokens, const PackedWeights& w2, const float* route_weights,
                            const int32_t* out_rows, float* out, int64_t out_stride, bool batch_invariant = false);

// One expert's rows in a fused MoE pass (fused_experts). Every pointer is the caller's; h is scratch.
struct ExpertRows {
  const PackedWeights* w13 = nullptr;    // pack_gate_up(w1, w3): I outputs over hidden
  const PackedWeights* w2 = nullptr;     // hidden outputs over I
  const float* x = nullptr;              // [rows, hidden] the expert's gathered tokens
  int64_t rows = 0;                      // 0: the expert is skipped
  float* h = nullptr;                    // [rows, I] written: silu(x w1^T) * (x w3^T)
  const float* route_weights = nullptr;  // [rows] each row's routing weight
  const int32_t* out_rows = nullptr;     // [rows] each row's row of out (distinct within one expert)
};
// The expert stage of a MoE layer in ONE parallel region, the same code for one token and for a prompt:
//   1. every expert's x rows converted for its kernel (bf16 rounding, W8A8 quantization, int4 group sums);
//   2. gate_up: work items (expert, run of w13 panels), sized by cost ~ (rows + a streaming floor) x panel
//      bytes so each thread gets a few of about equal cost, taken dynamically;
//   3. every h row converted for w2's kernel;
//   4. down + combine: work items are runs of w2 panels (output columns); each runs every expert in order
//      and adds route_weights[r] * (h w2^T)[r] into out[out_rows[r]], so no two threads write one element
//      and the sum over experts is in expert order (bitwise what expert_down_accumulate expert by expert gives).
// A barrier between the phases, no fork/join per expert. All experts share one format and shape. Without an
// x86 kernel (MOEX_ISA=ref) the scalar path runs expert_gate_up + expert_down_accumulate expert by expert.
// batch_invariant: every expert's rows run KernelChoice::for_rows(rows, true)'s loop.
void fused_experts(const ExpertRows* experts, int count, float* out, int64_t out_stride, bool batch_invariant = false);

// packed_matmul on a given ISA from usable_isas (tests and benchmarks compare the paths with it).
void packed_matmul_on(Isa isa, const float* x, int64_t tokens, const PackedWeights& w, float* y, bool accumulate = false,
                      bool batch_invariant = false);
// packed_matmul through one registered kernel (a row of registered_kernels() whose ISA this CPU runs), whatever the
// row count: the oracle test runs every row of the registry through it.
void packed_matmul_with(const KernelEntry& kernel, const float* x, int64_t tokens, const PackedWeights& w, float* y,
                        bool accumulate = false);

// W8A8 activations: scale = absmax / 127 (0 for an all-zero row), q = round-to-nearest-even(x * (127 / absmax)).
// Returns the scale. The fast path quantizes to exactly these values.
float quantize_activations_s8(const float* x, int64_t k, int8_t* q);

namespace ref {
// The oracles: plain loops over QuantizedMatrix::weight() (f32 sums). kBF16, kInt4 and kFP8E4M3 round x to bf16 first and
// kInt8W8A8 quantizes each row of x with quantize_activations_s8, kInt4W4A8 each K group of a row, as the fast
// kernels do.
void matmul(const float* x, int64_t tokens, const QuantizedMatrix& w, float* y, bool accumulate = false);
void expert_gate_up(const float* x, int64_t tokens, const QuantizedMatrix& w1, const QuantizedMatrix& w3, float* h);
void expert_down_accumulate(const float* h, int64_t tokens, const QuantizedMatrix& w2, const float* route_weights,
                            const int32_t* out_rows, float* out, int64_t out_stride);
}  // namespace ref

}  // namespace moex::kernels
