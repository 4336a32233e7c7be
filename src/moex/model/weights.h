// The Mixtral weights as views into the checkpoint mapping, every shape checked against the config, and
// sliced to what this rank computes under its ParallelPlan. Only the slices are paged in.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moex/base/tensor.h"
#include "moex/kernels/linear.h"
#include "moex/model/config.h"
#include "moex/model/safetensors.h"
#include "moex/moe/eplb.h"
#include "moex/moe/moe_layer.h"
#include "moex/moe/parallel_plan.h"

namespace moex {

// A dense projection W [out, in]: the checkpoint's bf16/f32 view (as stored, f32 activations), or packed weights:
// quantized at load (`--dense-weights`) or read from a quantized checkpoint's codes and scales. It runs through
// kernels::linear (kernels/linear.h), the op every weight x activation product of the model goes through.
using DenseWeight = kernels::Linear;

struct LayerWeights {
  TensorView input_norm;  // [d]
  DenseWeight wq;         // [H_local*hd, d]   this rank's query heads
  DenseWeight wk;         // [KV_local*hd, d]
  DenseWeight wv;         // [KV_local*hd, d]
  DenseWeight wo;         // [d, H_local*hd]   a column slice under attention TP (strided)
  TensorView bq, bk, bv;  // [H_local*hd], [KV_local*hd] q/k/v_proj biases (qwen2_moe), else empty
  TensorView q_norm, k_norm;  // per head: [hd] (qwen3_moe, dots1); whole: [H*hd], [KV*hd] (olmoe); else empty
  TensorView post_norm;   // [d]
  bool is_moe = true;     // false: a dense layer (mlp below), no router or experts
  MoELayerWeights moe;    // router [E, d] and this rank's experts / expert slices
  // Shared expert(s) of a MoE layer (qwen2_moe, dots1) or the dense MLP of a dense layer: gate/up [I_s, d],
  // down [d, I_s], whole on every rank (replicated under every plan). Empty when the layer has none.
  ExpertWeights mlp;
  TensorView shared_gate;  // [1, d] qwen2_moe's shared_expert_gate, else empty
};

struct DecoderWeights {
  std::unique_ptr<WeightStore> store;  // owns the mappings the views point into
  // Column slices under TP (w2, o_proj) copied out of the mapping: a strided slice would keep whole pages
  // of the other ranks' columns resident, so a rank's memory would not fall as 1/N.
  std::vector<std::vector<uint8_t>> owned;
  TensorView embed;       // [V, d]
  std::vector<LayerWeights> layers;
  TensorView final_norm;  // [d]
  DenseWeight lm_head;    // [V, d] (the embedding when tie_word_embeddings)
  int heads_local = 0, kv_heads_local = 0;
  int64_t intermediate_local = 0;
  double pack_seconds = 0.0;  // quantizing (or reading quantized codes) and packing at load (0 when as stored)
  bool quantized_checkpoint = false;  // config.json has a quantization_config: packed from the stored codes
  bool panels_mapped = false;  // ... or mapped from the panels.moex beside them (model/panels_file.h)
};

// Reads every value of every floating-point tensor (`--check-weights`, a full pass over the files) and throws
// Error(kInvalidInput) naming the first tensor, in name order, that holds a NaN or an infinity, and where.
void check_weights_finite(const WeightStore& store);

// Throws Error(kInvalidInput) naming the tensor for a missing tensor, a wrong shape or an unsupported dtype.
// With a packed `experts` format, every local expert is quantized and packed once here (layers[l].moe.packed);
// with a packed `dense` format, so are the attention projections and lm_head. The mapped pages a packed
// tensor was read from are released afterwards, so resident memory holds the packed copy only.
// A quantized checkpoint (config.quantization) is packed from its stored codes and scales (no quantization);
// its quantized modules then refuse a packed `experts` / `dense` format (they are quantized already), and they
// load whole (one rank, or whole experts under EP with unsliced attention).
// With a panels.moex (model/panels_file.h) at `panels_path`, else beside the checkpoint's files (`panels_path`
// empty; "none": never), a quantized checkpoint's quantized matrices, or a bf16/f16/f32 checkpoint's matrices
// packed to bf16 that are whole on this rank, are views into that file instead: no unpacking, no packing, no copy.
// A stale, damaged or other-path file is refused as PanelsFile::open says.
// With an expert `placement` (EPLB, EP plans only), each MoE layer's rank holds the slots the placement gives its
// EP rank, in slot order (layers[l].moe.experts is then a range of physical slots); an expert held twice is loaded
// (and packed) once and shared.
DecoderWeights load_mixtral_weights(const std::string& model_dir, const ModelConfig& config,
                                    const ParallelPlan& plan = ParallelPlan{},
                                    const ExpertWeightFormat& experts = ExpertWeightFormat{},
                                    const ExpertWeightFormat& dense = ExpertWeightFormat{},
                                    const eplb::ModelPlacement* placement = nullptr,
                                    const std::string& panels_path = "");

// EPLB's online rebalance: moves MoE layer `layer`'s experts on this rank to `placement` (this EP rank's slots of
// it). A slot whose expert the rank already holds shares that expert's views and packed buffers; any other expert
// is read from this rank's own mapping of the checkpoint and packed as at load (`format`). BF16/F32 checkpoints
// under an EP plan with a placement already (load_mixtral_weights'); the old buffers are freed when no slot
// refers to them. Returns the number of experts read and packed.
int rehome_layer_experts(DecoderWeights& weights, const ModelConfig& config, const ParallelPlan& plan, int layer,
                         const eplb::Placement& placement, const ExpertWeightFormat& format);

// W (bf16 or f32 [rows, cols], rows may be strided) in kernels::WeightFormat::kBF16 panels, written straight from
// the view in one pass: no f32 or bf16 copy in between, threads split the panels. With `w3`, the gate/up pair
// (kernels::pack_gate_up's layout). The same bytes as kernels::pack(quantize_bf16(w)) / pack_gate_up (unit-tested);
// what a load with --weights / --dense-weights bf16 (or auto) runs. `into`: the buffer to write the panels to
// (kernels::packed_layout's data size, 64-byte aligned, owned by the caller's shared arena), else allocated.
kernels::PackedWeights pack_bf16_direct(const TensorView& w, const TensorView* w3 = nullptr,
                                        std::shared_ptr<uint8_t> into = nullptr);

// One matrix a load packs (from a quantized checkpoint's stored codes, or a bf16/f32 checkpoint's weights to bf16):
// its name in panels.moex, its geometry (sizes only) and how to pack it (reads its source through the store, as the
// load does, and drops their pages).
struct PanelsToWrite {
  std::string name;
  kernels::PackedWeights layout;
  std::function<kernels::PackedWeights()> pack;
};
// Every such matrix of the checkpoint in `store` (one rank: all experts, whole modules), in load order. The
// functions refer to `store` and `config`, which must outlive them.
std::vector<PanelsToWrite> stored_panels(const WeightStore& store, const ModelConfig& config);
// Every matrix a bf16/f16/f32 checkpoint's load packs to bf16 under --weights auto on one rank (experts, attention
// q/k/v/o, lm_head, shared experts, dense MLP layers), whole, under the names load_mixtral_weights maps them by.
std::vector<PanelsToWrite> bf16_panels(const WeightStore& store, const ModelConfig& config);

}  // namespace moex
