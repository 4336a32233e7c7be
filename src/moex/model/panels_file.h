// panels.moex: a checkpoint's matrices already in the kernels' packed panels, so that a load maps them instead
// of packing every matrix (docs/kernels.md, "panels.moex"). Two kinds, told apart by moex_panels_weights:
// - "stored": a quantized checkpoint's matrices packed from its stored codes, written by `moex quantize` beside
//   the compressed-tensors files (or by `moex pack` beside a quantized checkpoint from elsewhere);
// - "bf16": a bf16/f16/f32 checkpoint's matrices as `--weights auto` packs them (experts, attention q/k/v/o,
//   lm_head, shared experts, dense MLP layers), written by `moex pack` only: nothing is written into a model
//   folder unless asked. `moex pack --out PATH` writes it elsewhere (a read-only folder) and `--panels PATH`
//   loads with it.
// HF and vLLM do not read it; without it a load packs as before.
//
// The file is a safetensors file (any safetensors reader lists it): per packed matrix M (names below), the
// PackedWeights buffers its format has, byte for byte: M.data U8, M.scales F32, M.offsets F32, M.col_sums I32,
// each 1-D. __metadata__: moex_panels_layout (kernels::kPackedLayoutVersion), moex_panels_weights (the kind above;
// absent in files of older builds: "stored"), moex_panels_source (what it was packed from: panels_source() of the
// checkpoint's files) and moex_checkpoint_id (theirs, for the reader). The
// header is padded to 4096 bytes and every buffer is a multiple of 64 bytes, so each tensor starts 64-byte
// aligned in the mapping (the kernels' aligned loads).
// Packed from other files than those beside it (a shard rewritten, the quantization_config edited) it is
// refused with an error, as WeightStore refuses shards of two checkpoints; from another layout version (an
// older MoEX) it is ignored with a warning and the load packs. A bf16 kind's source also covers each shard's size
// and mtime (its panels are the weights' values: a shard rewritten in place under the same header is refused); a
// stored kind's covers the headers and the quantization_config only, so whoever edits a quantized checkpoint's
// weights in place deletes its panels.moex (docs/kernels.md).
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

struct ExpertWeightFormat;  // moe/moe_layer.h

inline constexpr const char* kPanelsFileName = "panels.moex";
inline constexpr const char* kPanelsLayoutKey = "moex_panels_layout";
inline constexpr const char* kPanelsSourceKey = "moex_panels_source";
inline constexpr const char* kPanelsWeightsKey = "moex_panels_weights";
inline constexpr const char* kPanelsStored = "stored";  // moex_panels_weights of a quantized checkpoint's panels

// What a load wants of a panels file: its kind (kPanelsStored, or the format name "bf16") and its source.
struct PanelsKey {
  std::string weights;
  std::string source;
};
// A quantized checkpoint's: the fingerprint of the quantization_config and every shard's header
// (WeightStore::header_fingerprint), as 16 hex digits.
std::string panels_source(const WeightStore& store, const QuantizationConfig& qc);
PanelsKey panels_key(const WeightStore& store, const QuantizationConfig& qc);
// A bf16/f16/f32 checkpoint's packed to `format` (kernels::weight_format_name): every shard's header, size and
// mtime.
PanelsKey panels_key(const WeightStore& store, kernels::WeightFormat format);

// The kind of panels (PanelsKey::weights) a load wants, decided here for the load (load_mixtral_weights) and for the
// run-memory estimate before it: kPanelsStored for a quantized checkpoint; for a bf16/f16/f32 one "bf16" when its
// experts or its dense matrices pack to bf16, else the format they pack to (experts' first; a kind moex pack never
// writes, so only a --panels file could hold it); empty when the load packs nothing.
std::string panels_kind(bool quantized_checkpoint, const ExpertWeightFormat& experts, const ExpertWeightFormat& dense);
// Whether a file of `kind` may lie beside the checkpoint, so a load without --panels looks there: the kinds moex
// quantize and moex pack write (kPanelsStored, "bf16").
bool panels_kind_written_beside(const std::string& kind);

// Where a load looks for a checkpoint's panels when --panels is not given: `model_dir`/panels.moex.
std::string default_panels_path(const std::string& model_dir);

// Whether a load of `model_dir` with `panels_path` (--panels: a path, "none", or empty for the one beside the
// checkpoint) finds panels of `kind` (kPanelsStored or a format name, PanelsKey::weights) in this build's layout,
// so that its whole matrices are mapped rather than copied. Only the file's metadata is read: whether it was packed
// from these very weights is the load's check (a stale file is refused there). For the run-memory estimate, which
// runs before the load; false for a missing or unreadable file (the load reports it).
bool panels_present(const std::string& model_dir, const std::string& panels_path, const std::string& kind);

class PanelsFile : public std::enable_shared_from_this<PanelsFile> {
 public:
  // The panels file at `path` when it holds `want`'s kind and source in this build's layout. Found beside the
  // checkpoint (`given` false), it is optional: nullptr when there is none, when it holds another kind (another
  // --weights path: an info line) or another layout version (a warning line). Named by --panels (`given`), each
  // of those is an error. Either way Error(kInvalidInput), one line naming the file and how to rebuild it, when it
  // is not a valid safetensors file (truncated, damaged) or was packed from other files (stale).
  // `model_dir` names the checkpoint in the messages (how to rebuild: moex pack --model model_dir).
  static std::shared_ptr<const PanelsFile> open(const std::string& path, const PanelsKey& want, bool given,
                                                const std::string& model_dir);

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
