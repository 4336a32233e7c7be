// panels.moex: a quantized checkpoint's matrices already in the kernels' packed panels, written by `moex
// quantize` beside the compressed-tensors files (or by `moex pack` beside a quantized checkpoint from elsewhere)
// so that a load maps them instead of unpacking the stored codes and repacking every matrix (docs/kernels.md,
// "Quantized checkpoints"). HF and vLLM do not read it; without it a load packs as before.
//
// The file is a safetensors file (any safetensors reader lists it): per packed matrix M (names below), the
// PackedWeights buffers its format has, byte for byte: M.data U8, M.scales F32, M.offsets F32, M.col_sums I32,
// each 1-D. __metadata__: moex_panels_layout (kernels::kPackedLayoutVersion), moex_panels_source (what it was
// packed from: panels_source() of the checkpoint's files) and moex_checkpoint_id (theirs, for the reader). The
// header is padded to 4096 bytes and every buffer is a multiple of 64 bytes, so each tensor starts 64-byte
// aligned in the mapping (the kernels' aligned loads).
// Packed from other files than those beside it (a shard rewritten, the quantization_config edited) it is
// refused with an error, as WeightStore refuses shards of two checkpoints; from another layout version (an
// older MoEX) it is ignored with a warning and the load packs. What the fingerprint cannot see is a tensor's
// values rewritten in place under the same header: whoever edits a quantized checkpoint's weights deletes
// its panels.moex (docs/kernels.md).
// Names: a dense module's own ("model.layers.0.self_attn.q_proj", "lm_head"); an expert's fused gate/up and
// its down projection as "<expert prefix>gate_up" and "<expert prefix>down"
// ("model.layers.0.block_sparse_moe.experts.3.gate_up").
#pragma once
#include <memory>
#include <string>

#include "moex/kernels/packed.h"
#include "moex/model/quantization.h"
#include "moex/model/safetensors.h"

namespace moex {

inline constexpr const char* kPanelsFileName = "panels.moex";
inline constexpr const char* kPanelsLayoutKey = "moex_panels_layout";
inline constexpr const char* kPanelsSourceKey = "moex_panels_source";

// The fingerprint of what a load packs from: the quantization_config and every shard's header
// (WeightStore::header_fingerprint), as 16 hex digits.
std::string panels_source(const WeightStore& store, const QuantizationConfig& qc);

class PanelsFile : public std::enable_shared_from_this<PanelsFile> {
 public:
  // `dir`/panels.moex when it exists, was packed from `store`'s files under `qc`, and has this build's layout;
  // nullptr when there is none, or (after a warning line) when its layout is another version's. Throws
  // Error(kInvalidInput) naming the file when it is not a valid safetensors file or was packed from other files.
  static std::shared_ptr<const PanelsFile> open(const std::string& dir, const WeightStore& store,
                                                const QuantizationConfig& qc);

  // Matrix `name` with `layout`'s geometry (kernels::packed_layout), its buffers views into the mapping that
  // keep it alive. Throws Error(kInvalidInput) naming the file and tensor when one is missing, of another
  // dtype or size than the layout's, or misaligned.
  std::shared_ptr<kernels::PackedWeights> get(const std::string& name, const kernels::PackedWeights& layout) const;

  // Buffer b of a packed matrix (kernels::PackedWeights::buffer: 0 data, 1 scales, 2 offsets, 3 col_sums): the
  // dtype it is written in and its tensor name's suffix.
  static DType buffer_dtype(int buffer);
  static const char* buffer_suffix(int buffer);

  explicit PanelsFile(const std::string& path) : file_(path) {}

 private:
  SafetensorsFile file_;
};

}  // namespace moex
